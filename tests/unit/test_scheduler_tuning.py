"""The knobs that map onto the tuning: each one's bounds, and where it lands in the profile.

Every knob of :class:`Tuning` is a setting (FERRY_<NAME>); the refusals here
are what a program that builds a Tuning or a Profile itself (the simulator,
a benchmark) is told, so each names the knob and its range in full.
"""

from __future__ import annotations

import math
import re

import pytest

from scheduler.learning import BatchObservation, SchedulerState, Tuning
from scheduler.policy import INF, LinearFit, Profile


def refused(message: str) -> pytest.RaisesExc[ValueError]:
    return pytest.raises(ValueError, match=f"^{re.escape(message)}$")


WINDOW = "window bounds must satisfy 0 <= min <= max"
TUNING_REFUSALS = [
    ({"batch_max_size": 0}, "batch_max_size must be at least 1"),
    ({"batch_max_cost": 0}, "batch_max_cost must be positive"),
    ({"batch_max_cost": -5.0}, "batch_max_cost must be positive"),
    ({"batch_window_min_ms": -1.0}, WINDOW),
    ({"batch_window_min_ms": 30.0, "batch_window_max_ms": 20.0}, WINDOW),
    ({"memory_threshold": 0.0}, "memory_threshold must be in (0, 1]"),
    ({"memory_threshold": 1.5}, "memory_threshold must be in (0, 1]"),
    ({"bulk_share": 1.0}, "bulk_share must be in [0, 1)"),
    ({"bulk_share": -0.1}, "bulk_share must be in [0, 1)"),
    ({"batch_cost_history_weight": 1.0}, "batch_cost_history_weight must be in [0, 1)"),
    ({"batch_cost_history_weight": -0.1}, "batch_cost_history_weight must be in [0, 1)"),
    ({"learning_forget": 0.0}, "learning_forget must be in (0, 1] and oom_backoff in (0, 1)"),
    ({"learning_forget": 1.5}, "learning_forget must be in (0, 1] and oom_backoff in (0, 1)"),
    ({"oom_backoff": 0.0}, "learning_forget must be in (0, 1] and oom_backoff in (0, 1)"),
    ({"oom_backoff": 1.0}, "learning_forget must be in (0, 1] and oom_backoff in (0, 1)"),
    ({"urgent_guard": 0.5}, "urgent_guard and urgent_budget must be at least 1"),
    ({"urgent_budget": 0.5}, "urgent_guard and urgent_budget must be at least 1"),
    ({"urgent_memory_s": -0.1}, "urgent_memory_s must not be negative"),
    ({"batch_min_efficiency": -0.1}, "batch_min_efficiency must be in [0, 1]"),
    ({"batch_min_efficiency": 1.5}, "batch_min_efficiency must be in [0, 1]"),
]  # fmt: skip


@pytest.mark.parametrize(("knobs", "message"), TUNING_REFUSALS)
def test_a_knob_out_of_its_range_is_refused_by_name(knobs: dict[str, float], message: str) -> None:
    with refused(message):
        Tuning(**knobs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "knobs",
    [
        {"batch_max_size": 1},
        {"batch_max_cost": 0.5},
        {"batch_window_min_ms": 0.0, "batch_window_max_ms": 0.0},
        {"batch_window_min_ms": 20.0, "batch_window_max_ms": 20.0},
        {"memory_threshold": 1.0},
        {"bulk_share": 0.0},
        {"batch_cost_history_weight": 0.0},
        {"learning_forget": 1.0},
        {"oom_backoff": 0.01},
        {"oom_backoff": 0.99},
        {"urgent_guard": 1.0, "urgent_budget": 1.0},
        {"urgent_budget": 1.5},
        {"urgent_guard": INF, "urgent_budget": INF},
        {"urgent_memory_s": 0.0},
        {"batch_min_efficiency": 0.0},
        {"batch_min_efficiency": 1.0},
    ],
)
def test_the_ends_of_each_range_are_accepted(knobs: dict[str, float]) -> None:
    tuning = Tuning(**knobs)  # type: ignore[arg-type]
    for name, value in knobs.items():
        assert getattr(tuning, name) == value


PROFILE_REFUSALS = [
    ({"max_batch_size": 0}, "max_batch_size must be at least 1"),
    ({"window_s": -0.5}, "window_s must be a non-negative number"),
    ({"window_s": math.nan}, "window_s must be a non-negative number"),
    ({"max_batch_cost": 0}, "max_batch_cost must be positive"),
    ({"bulk_slots": -1}, "bulk_slots and idle_queue must not be negative"),
    ({"idle_queue": -1}, "bulk_slots and idle_queue must not be negative"),
    ({"max_batch_s": 0.0}, "max_batch_s and urgent_latency_s must be positive"),
    ({"urgent_latency_s": 0.0}, "max_batch_s and urgent_latency_s must be positive"),
    ({"min_efficiency": 1.5}, "min_efficiency must be in [0, 1]"),
    ({"min_efficiency": -0.5}, "min_efficiency must be in [0, 1]"),
    ({"bulk_ride_factor": 0.5}, "bulk_ride_factor must be at least 1"),
]


@pytest.mark.parametrize(("fields", "message"), PROFILE_REFUSALS)
def test_a_profile_out_of_range_is_refused_by_name(fields: dict[str, float], message: str) -> None:
    with refused(message):
        Profile(**{"max_batch_size": 4, "window_s": 0.0, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {"max_batch_cost": 0.5},
        {"idle_queue": 0, "bulk_slots": 0},
        {"max_batch_s": 1e-6, "urgent_latency_s": 1e-6},
        {"min_efficiency": 1.0},
        {"bulk_ride_factor": 1.0},
    ],
)
def test_a_profile_at_the_ends_of_its_ranges_is_accepted(fields: dict[str, float]) -> None:
    profile = Profile(**{"max_batch_size": 4, "window_s": 0.0, **fields})  # type: ignore[arg-type]
    for name, value in fields.items():
        assert getattr(profile, name) == value


# --- from the tuning to the profile ---------------------------------------------------


def batch(
    latency_s: float = 0.01, ended_s: float = 0.0, lanes: tuple[str, ...] = ("normal",)
) -> BatchObservation:
    return BatchObservation(
        size=len(lanes), cost=10, work=10, latency_s=latency_s, ended_s=ended_s, lanes=lanes
    )


def test_every_knob_reaches_the_profile() -> None:
    tuning = Tuning(
        batch_max_size=64, batch_max_cost=4096, padded=True, memory_budget_bytes=1000.0,
        memory_threshold=0.5, bulk_share=0.1, idle_queue_max=3, batch_min_efficiency=0.85,
        bulk_ride_factor=1.5,
    )  # fmt: skip
    latency, memory = LinearFit(0.002, 1e-6), LinearFit(100.0, 0.1)
    state = SchedulerState.create(tuning, latency_prior=latency, memory_prior=memory)
    state.target_cost = 900.0
    profile = state.profile(0.0)
    assert profile.max_batch_size == 64
    assert profile.max_batch_cost == 4096
    assert profile.target_cost == 900.0
    assert profile.padded is True
    for learned, prior in ((profile.latency, latency), (profile.memory, memory)):
        assert learned.intercept == pytest.approx(prior.intercept)
        assert learned.slope == pytest.approx(prior.slope)
    assert profile.memory_limit == 500.0  # the threshold's share of the budget
    assert profile.bulk_slots == 7  # 10 % of 64 slots, rounded up
    assert profile.idle_queue == 3
    assert profile.min_efficiency == 0.85
    assert profile.bulk_ride_factor == 1.5
    # No urgent traffic: no batch length bound.
    assert profile.max_batch_s == INF and profile.urgent_latency_s == INF


def test_the_window_is_the_minimum_until_one_is_learned_then_the_learned_one() -> None:
    state = SchedulerState.create(Tuning(batch_window_min_ms=5.0, batch_window_max_ms=1000.0))
    assert state.profile(0.0).window_s == pytest.approx(0.005)
    state.observe_batch(batch(latency_s=0.020, ended_s=0.0))
    assert state.profile(0.0).window_s == pytest.approx(0.030)  # 1.5 x the first batch


def test_the_model_is_idle_once_a_window_has_passed_since_the_last_batch() -> None:
    state = SchedulerState.create(Tuning(batch_window_max_ms=1000.0))
    assert state.profile(0.0).idle  # nothing ran yet
    state.observe_batch(batch(latency_s=0.5, ended_s=1.0))  # window 0.75 s
    assert state.window_s == 0.75
    assert not state.profile(1.5).idle
    assert state.profile(1.75).idle  # exactly one window later
    assert state.profile(9.0).idle


def test_bulk_gets_a_turn_after_one_over_its_share_batches_without_it() -> None:
    state = SchedulerState.create(Tuning(bulk_share=0.25))
    turns = []
    for lanes in [("normal",)] * 5 + [("normal", "bulk")] + [("vip",)] * 4:
        state.observe_batch(batch(lanes=lanes))
        turns.append(state.profile(0.0).bulk_turn)
    # Its turn comes after 4 batches without bulk, and a batch with bulk resets the count.
    assert turns == [False, False, False, True, True, False, False, False, False, True]


def test_no_bulk_share_means_no_reserved_slots_and_no_turns() -> None:
    state = SchedulerState.create(Tuning(bulk_share=0.0, batch_max_size=8))
    for _ in range(50):
        state.observe_batch(batch())
    profile = state.profile(0.0)
    assert profile.bulk_slots == 0 and not profile.bulk_turn


def test_a_batch_of_one_slot_still_reserves_one_for_bulk() -> None:
    # The policy keeps that slot for the interactive lanes (the reservation is capped there).
    assert SchedulerState.create(Tuning(batch_max_size=1)).profile(0.0).bulk_slots == 1


def test_batches_are_counted() -> None:
    state = SchedulerState.create(Tuning())
    for _ in range(3):
        state.observe_batch(batch())
    assert state.batches == 3


def test_the_latency_target_is_three_smoothed_batch_latencies_unless_set() -> None:
    state = SchedulerState.create(Tuning())
    assert state.latency_target_s == 0.0  # nothing measured yet
    state.observe_batch(batch(latency_s=0.010))
    assert state.latency_target_s == pytest.approx(0.030)
    state.observe_batch(batch(latency_s=0.020))  # the average moves a fifth of the way
    assert state.latency_target_s == pytest.approx(3 * (0.8 * 0.010 + 0.2 * 0.020))
    assert SchedulerState.create(Tuning(latency_target_ms=80.0)).latency_target_s == 0.08


@pytest.mark.parametrize(
    ("job_latency_s", "factor"),
    [(0.1875 + 1e-6, 0.5), (0.1875, 1.0), (0.0625, 1.0), (0.0625 - 1e-6, 2.0)],
)
def test_the_window_moves_only_strictly_beyond_the_latency_bounds(
    job_latency_s: float, factor: float
) -> None:
    # Target 125 ms: shrink above 1.5 x (187.5 ms), grow below 0.5 x (62.5 ms).
    tuning = Tuning(
        batch_window_max_ms=1000.0, latency_target_ms=125.0, latency_high_factor=1.5,
        latency_low_factor=0.5, batch_window_shrink=0.5, batch_window_grow=2.0,
    )  # fmt: skip
    state = SchedulerState.create(tuning)
    state.observe_batch(batch(latency_s=0.1))
    before = state.window_s
    assert before is not None
    seen = BatchObservation(
        size=4, cost=40, work=40, latency_s=0.1, ended_s=0.0, job_latency_s=[job_latency_s] * 4
    )
    state.observe_batch(seen)
    assert state.window_s == pytest.approx(before * factor)
