"""The urgent latency guard: while urgent jobs are about, batches stay short.

A GPU cannot be preempted, so an urgent job waits for the batch already
running. For ``urgent_memory_s`` after an urgent job arrived, no batch may be
predicted to take longer than ``urgent_guard`` x a lone item's latency, and
the items riding with urgent ones must let those finish within
``urgent_budget`` x it of their arrival. The urgent jobs themselves always run.

The riders' budget is tested with times and costs that are powers of two, so
its arithmetic is exact at the boundaries.
"""

from __future__ import annotations

import math

import pytest

from scheduler import Batcher, PendingItem
from scheduler.learning import BatchObservation, SchedulerState, Tuning
from scheduler.policy import LinearFit, Profile, decide

FIT = LinearFit(0.01, 0.001)  # 10 ms a batch, 1 ms a unit of work


def guarded() -> SchedulerState:
    tuning = Tuning(urgent_guard=1.5, urgent_budget=2.5, urgent_memory_s=1.0)
    return SchedulerState.create(tuning, latency_prior=FIT)


def bounds(state: SchedulerState, now: float) -> tuple[float, float]:
    profile = state.profile(now)
    return profile.max_batch_s, profile.urgent_latency_s


def test_an_urgent_arrival_bounds_the_batches_for_urgent_memory_s() -> None:
    state = guarded()
    state.observe_arrival(10, "urgent", now=5.0)
    lone_s = FIT(10)  # one item of the usual cost, alone: 20 ms
    assert bounds(state, 5.0) == pytest.approx((1.5 * lone_s, 2.5 * lone_s))
    assert bounds(state, 6.0) == pytest.approx((1.5 * lone_s, 2.5 * lone_s))  # still about
    assert bounds(state, 6.001) == (math.inf, math.inf)


def test_other_lanes_bound_nothing() -> None:
    state = guarded()
    for lane in ("vip", "normal", "bulk"):
        state.observe_arrival(10, lane, now=5.0)
    assert bounds(state, 5.0) == (math.inf, math.inf)


def test_without_a_time_the_last_batchs_end_stands_in() -> None:
    state = guarded()
    state.observe_arrival(10, "urgent")  # no time, and no batch yet: nothing to go by
    assert bounds(state, 0.0) == (math.inf, math.inf)
    state.observe_batch(BatchObservation(size=1, cost=10, work=10, latency_s=0.02, ended_s=4.0))
    state.observe_arrival(10, "urgent")
    assert bounds(state, 4.5)[0] < math.inf
    assert bounds(state, 5.5) == (math.inf, math.inf)


def test_a_lone_item_costs_the_moving_average_of_arrivals() -> None:
    state = guarded()
    state.observe_arrival(10, "urgent", now=5.0)
    state.observe_arrival(110, "urgent", now=5.0)  # the average moves 1 % of the way: 11
    assert bounds(state, 5.0) == pytest.approx((1.5 * FIT(11), 2.5 * FIT(11)))


def test_a_lone_item_costs_at_least_one_unit() -> None:
    state = guarded()
    state.observe_arrival(0, "urgent", now=5.0)
    assert bounds(state, 5.0) == pytest.approx((1.5 * FIT(1), 2.5 * FIT(1)))


@pytest.mark.parametrize("prior", [None, LinearFit(0.0, 0.0)])
def test_no_bound_while_nothing_says_how_long_a_batch_takes(prior: LinearFit | None) -> None:
    tuning = Tuning(urgent_guard=1.5, urgent_budget=2.5, urgent_memory_s=1.0)
    state = SchedulerState.create(tuning, latency_prior=prior)
    state.observe_arrival(10, "urgent", now=5.0)
    assert bounds(state, 5.0) == (math.inf, math.inf)


def test_the_batcher_passes_each_items_lane_and_time_on() -> None:
    b: Batcher[str] = Batcher(guarded())
    b.add(PendingItem("u", "urgent", 10, arrival_s=2.5), "u", now=3.0)
    assert bounds(b.state, 3.5)[0] < math.inf
    assert bounds(b.state, 4.5) == (math.inf, math.inf)  # 1.5 s after it was seen


def test_the_guard_caps_the_work_of_every_batch() -> None:
    state = guarded()
    state.observe_arrival(10, "urgent", now=0.0)
    # At most 1.5 x 20 ms = 30 ms: 20 units of work, two items of 8.
    pending = [PendingItem(f"n{i}", "normal", 8, arrival_s=0.0) for i in range(5)]
    decision = decide(pending, state.profile(0.5), 0.5)
    assert [i.key for i in decision.run] == ["n0", "n1"]
    assert decision.trigger == "latency"


# --- the riders' budget -----------------------------------------------------------------

EXACT = LinearFit(1 / 128, 1 / 1024)  # 7.8125 ms a batch, 1/1024 s a unit of work


def budget(**fields: object) -> Profile:
    base: dict[str, object] = {
        "max_batch_size": 8, "window_s": 1.0, "latency": EXACT, "urgent_latency_s": 0.125,
    }  # fmt: skip
    return Profile(**{**base, **fields})  # type: ignore[arg-type]


def item(key: str, lane: str, cost: int, arrival_s: float = 0.5) -> PendingItem:
    return PendingItem(key, lane, cost, arrival_s=arrival_s)


def keys(decision_run: tuple[PendingItem, ...]) -> list[str]:
    return [i.key for i in decision_run]


def test_riders_fill_the_urgent_jobs_budget_exactly_and_no_more() -> None:
    # The urgent job waited 62.5 ms of its 125: 62.5 ms left, 56 units of work. It
    # costs 8; three riders of 16 make 56 exactly, a fourth would cross.
    pending = [item("u", "urgent", 8, arrival_s=1.0)] + [
        item(f"n{i}", "normal", 16) for i in range(5)
    ]
    decision = decide(pending, budget(), now=1.0625)
    assert keys(decision.run) == ["u", "n0", "n1", "n2"]
    assert decision.trigger == "urgent"


def test_every_urgent_job_runs_the_budget_limits_only_the_riders() -> None:
    pending = [item(f"u{i}", "urgent", 32, arrival_s=1.0) for i in range(3)] + [
        item("n", "normal", 1)
    ]
    decision = decide(pending, budget(), now=1.0625)
    assert keys(decision.run) == ["u0", "u1", "u2"]


@pytest.mark.parametrize("now", [1.125, 1.25])
def test_an_urgent_job_whose_budget_is_spent_takes_no_riders(now: float) -> None:
    # Even where batches are predicted to take no time at all.
    pending = [item("u", "urgent", 8, arrival_s=1.0), item("n", "normal", 1)]
    for latency in (EXACT, LinearFit()):
        assert keys(decide(pending, budget(latency=latency), now).run) == ["u"]


def test_the_reserved_bulk_slot_rides_within_the_budget_too() -> None:
    pending = (
        [item("u", "urgent", 8, arrival_s=1.0)]
        + [item(f"n{i}", "normal", 16) for i in range(5)]
        + [item("b", "bulk", 8)]
    )
    decision = decide(pending, budget(bulk_slots=1), now=1.0625)
    assert keys(decision.run) == ["u", "n0", "n1", "n2"]


def test_an_urgent_lane_cut_by_the_cost_cap_is_not_overtaken() -> None:
    pending = [item(f"u{i}", "urgent", 40, arrival_s=1.0) for i in range(3)] + [
        item("v", "vip", 10)
    ]
    # Without a budget; and with one that would leave the vip job room (96 units).
    decision = decide(pending, budget(max_batch_cost=100, urgent_latency_s=math.inf), now=1.0)
    assert keys(decision.run) == ["u0", "u1"]
    decision = decide(pending, budget(max_batch_cost=100), now=1.0 + 3 / 128)
    assert keys(decision.run) == ["u0", "u1"]


# --- a padded model's urgent jobs ---------------------------------------------------------


def test_every_urgent_job_that_fits_runs_in_a_padded_batch_whatever_its_cost() -> None:
    # Two fit the cost cap (2 x 50); the 40 is not of the band the others would make.
    pending = [
        item("u0", "urgent", 50, arrival_s=0.0),
        item("u1", "urgent", 40, arrival_s=0.1),
        item("u2", "urgent", 50, arrival_s=0.2),
    ] + [item(f"n{i}", "normal", 50, arrival_s=1.0) for i in range(10)]
    prof = budget(
        padded=True, max_batch_cost=100, urgent_latency_s=math.inf, latency=LinearFit(0.002, 1e-6)
    )
    assert keys(decide(pending, prof, now=2.0).run) == ["u0", "u1"]


def test_items_of_the_urgent_jobs_cost_ride_with_them_in_a_padded_batch() -> None:
    pending = [item(f"u{i}", "urgent", 10, arrival_s=0.0) for i in range(2)] + [
        item(f"n{i}", "normal", 10, arrival_s=1.0) for i in range(3)
    ]
    prof = budget(padded=True, urgent_latency_s=math.inf, latency=LinearFit(0.002, 1e-6))
    assert keys(decide(pending, prof, now=2.0).run) == ["u0", "u1", "n0", "n1", "n2"]
