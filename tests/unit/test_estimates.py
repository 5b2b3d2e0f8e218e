"""The jobs ahead of a new one, with the lanes' tenants taken in turn."""

from __future__ import annotations

from core.estimates import jobs_ahead


def depths(**lanes: dict[str, int]) -> dict[str, dict[str, int]]:
    return {lane: lanes.get(lane, {}) for lane in ("urgent", "vip", "normal", "bulk")}


def test_another_tenants_flood_counts_for_one_turn() -> None:
    queue = depths(normal={"flood": 5000})
    assert jobs_ahead(queue, "normal", "me") == 1
    assert jobs_ahead(queue, "normal", "flood") == 5000


def test_each_other_tenant_counts_up_to_the_own_queue_plus_one() -> None:
    queue = depths(normal={"me": 3, "a": 10, "b": 2, "": 1})
    assert jobs_ahead(queue, "normal", "me") == 3 + 4 + 2 + 1


def test_higher_lanes_count_whole_and_lower_lanes_not_at_all() -> None:
    queue = depths(urgent={"x": 2}, vip={"y": 7}, normal={"me": 1}, bulk={"z": 900})
    assert jobs_ahead(queue, "normal", "me") == 2 + 7 + 1
    assert jobs_ahead(queue, "urgent", "me") == 1  # x has one turn before it
