"""The jobs ahead of a new one, with the lanes' tenants taken in turn; a worker's capacity."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from core.models.estimates import ModelEstimate, jobs_ahead


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


def test_a_workers_capacity_is_full_batches_of_the_usual_job() -> None:
    est = ModelEstimate(
        latency_a_s=0.02,
        latency_b_s=0.0005,
        padded=False,
        max_batch_size=32,
        max_batch_cost=math.inf,
        mean_cost=10.0,
    )
    assert est.jobs_per_second() == pytest.approx(32 / (0.02 + 0.0005 * 320))
    capped = replace(est, max_batch_cost=100.0)  # ten jobs of cost 10 fill a batch
    assert capped.full_batch(10.0) == 10
    assert capped.jobs_per_second() == pytest.approx(10 / (0.02 + 0.0005 * 100))
    padded = replace(est, padded=True, pad_ratio=2.0)  # each job costs twice its tokens
    assert padded.jobs_per_second() == pytest.approx(32 / (0.02 + 0.0005 * 640))
    unseen = replace(est, mean_cost=0.0)  # no job seen yet: a job of cost 1
    assert unseen.jobs_per_second() == pytest.approx(32 / (0.02 + 0.0005 * 32))
