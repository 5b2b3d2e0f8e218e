"""The bulk lane (backfills): its reserved slots and its turns, padded or not.

While bulk is backlogged, ``bulk_slots`` of each batch are kept for it (never
all of a batch: an interactive item always has a place); in a padded batch
they take the run of similar bulk costs that most raises the batch's useful
work per second, if any does. Every so often bulk has a turn: its first job
leads a batch (unless an urgent one waits), and the batch fills as usual.
"""

from __future__ import annotations

import dataclasses
import math
import random

from scheduler.policy import LinearFit, PendingItem, Profile, decide
from tests.unit.test_scheduler_rules import item


def profile(**fields: object) -> Profile:
    base: dict[str, object] = {"max_batch_size": 8, "window_s": 0.0}
    return Profile(**{**base, **fields})  # type: ignore[arg-type]


def ran(pending: list[PendingItem], prof: Profile, now: float = 10.0) -> list[str]:
    return [i.key for i in decide(pending, prof, now).run]


def normals(count: int, cost: int = 10) -> list[PendingItem]:
    return [item(f"n{i}", cost=cost, arrival_s=i / 64) for i in range(count)]


def bulk(count: int, cost: int = 10) -> list[PendingItem]:
    return [item(f"b{i}", "bulk", cost=cost, arrival_s=i / 64) for i in range(count)]


# --- reserved slots -----------------------------------------------------------------------


def test_the_reserved_slots_are_not_lost_when_the_interactive_lanes_leave_room() -> None:
    assert ran(normals(2) + bulk(10), profile(bulk_slots=2)) == [
        "n0", "n1", "b0", "b1", "b2", "b3", "b4", "b5",
    ]  # fmt: skip


def test_a_batch_of_one_keeps_no_slot_from_the_interactive_lanes() -> None:
    for padded in (False, True):
        assert ran(
            normals(1) + bulk(3), profile(max_batch_size=1, bulk_slots=1, padded=padded)
        ) == ["n0"]


def test_a_padded_batch_keeps_the_reserved_share_for_bulk() -> None:
    decision = decide(normals(20) + bulk(20), profile(padded=True, bulk_slots=2), 10.0)
    assert [i.lane for i in decision.run] == ["normal"] * 6 + ["bulk"] * 2


def test_bulk_alone_fills_a_padded_batch() -> None:
    assert len(ran(bulk(20), profile(padded=True, bulk_slots=2))) == 8


def test_the_reserved_slots_take_the_bulk_items_closest_in_cost() -> None:
    pending = [
        *normals(4), item("b-long", "bulk", 200), item("b10", "bulk", 10),
        item("b12", "bulk", 12), item("b11", "bulk", 11),
    ]  # fmt: skip
    prof = profile(padded=True, bulk_slots=2, latency=LinearFit(1e-3, 1e-5))
    assert ran(pending, prof) == ["n0", "n1", "n2", "n3", "b10", "b11"]


def best_bulk_run(
    base: list[PendingItem], items: list[PendingItem], slots: int, prof: Profile
) -> list[PendingItem]:
    """The run of consecutive bulk costs (at most ``slots``, within the cap) that most
    raises the useful work per second of ``base``; none if none raises it."""
    base_cost, base_max = sum(i.cost for i in base), max(i.cost for i in base)
    best_rate = base_cost / prof.latency(len(base) * base_max)
    best: list[PendingItem] = []
    by_cost = sorted(items, key=lambda i: i.cost)
    for start in range(len(by_cost)):
        for end in range(start + 1, min(start + slots, len(by_cost)) + 1):
            group = by_cost[start:end]
            work = (len(base) + len(group)) * max(base_max, group[-1].cost)
            if work > prof.max_batch_cost:
                continue
            rate = (base_cost + sum(i.cost for i in group)) / prof.latency(work)
            if rate > best_rate * (1 + 1e-9):
                best_rate, best = rate, group
    return best


def test_the_reserved_slots_take_the_run_of_costs_that_most_raises_throughput() -> None:
    rng = random.Random(5)
    for case in range(300):
        cost = rng.choice([8, 16, 32])
        interactive = normals(rng.randint(1, 5), cost)
        waiting = [
            item(f"b{n}", "bulk", c, arrival_s=n / 64)
            for n, c in enumerate(rng.sample(range(1, 80), rng.randint(1, 8)))
        ]
        slots = rng.randint(1, 4)
        size = len(interactive) + slots + rng.randint(0, 2)
        prof = profile(
            max_batch_size=size,
            padded=True,
            bulk_slots=slots,
            max_batch_cost=rng.choice([math.inf, cost * size, cost * len(interactive) + 40]),
            latency=LinearFit(rng.uniform(1e-4, 1e-2), rng.uniform(1e-5, 1e-3)),
        )
        reserved = min(slots, len(waiting), size - 1)
        room = min(
            size - reserved,
            int(prof.max_batch_cost // cost) if math.isfinite(prof.max_batch_cost) else size,
        )
        base = interactive[: max(1, room)]
        expected = base + best_bulk_run(base, waiting, reserved, prof)
        assert sorted(ran(interactive + waiting, prof)) == sorted(i.key for i in expected), case


# --- turns ----------------------------------------------------------------------------------


def test_on_its_turn_the_first_bulk_job_leads_and_the_lanes_follow_as_usual() -> None:
    pending = [item("b0", "bulk", arrival_s=0.0), item("b1", "bulk", arrival_s=0.5)] + [
        item(f"n{i}", arrival_s=1.0 + i) for i in range(2)
    ]
    assert ran(pending, profile(bulk_turn=True)) == ["b0", "n0", "n1", "b1"]


def test_on_its_turn_a_padded_batch_is_led_by_bulk_and_filled_with_its_cost() -> None:
    pending = [item("b", "bulk", arrival_s=0.0)] + [
        item(f"n{i}", arrival_s=1.0 + i, deadline_s=100.0) for i in range(6)
    ]
    run = ran(pending, profile(padded=True, bulk_turn=True, max_batch_size=4), now=2.0)
    assert run == ["b", "n0", "n1", "n2"]


def test_on_its_turn_bulk_leads_even_over_an_item_due() -> None:
    # n-due has waited three quarters of its time: without the turn, it would lead.
    pending = [
        item("b", "bulk", cost=10, arrival_s=0.0),
        item("n-due", cost=200, arrival_s=0.0, deadline_s=2.0),
        *normals(3),
    ]
    prof = profile(padded=True, latency=LinearFit(1e-4, 1e-4))
    assert ran(pending, prof, now=1.5)[0] == "n-due"
    assert ran(pending, dataclasses.replace(prof, bulk_turn=True), now=1.5)[0] == "b"


# --- riders -----------------------------------------------------------------------------------

# 31.25 ms a batch + 3.90625 ms a unit: 8 units take 62.5 ms, 16 take 93.75 ms (1.5 x).
RIDE = LinearFit(1 / 32, 1 / 256)


def test_bulk_rides_until_it_would_stretch_the_batch_past_the_factor() -> None:
    pending = [item("n", cost=8), *bulk(3, cost=8)]
    for padded in (False, True):
        prof = profile(latency=RIDE, bulk_ride_factor=1.5, padded=padded)
        decision = decide(pending, prof, 10.0)
        # One rider makes exactly 1.5 x: it rides; a second would cross.
        assert [i.key for i in decision.run] == ["n", "b0"]
        assert decision.trigger == "latency"


def test_every_reserved_slot_rides_whatever_the_factor() -> None:
    pending = [item("n", cost=8), *bulk(4, cost=8)]
    prof = profile(latency=RIDE, bulk_ride_factor=1.0, bulk_slots=2)
    assert ran(pending, prof) == ["n", "b0", "b1"]
