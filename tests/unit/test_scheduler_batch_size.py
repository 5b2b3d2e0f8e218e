"""A model's batch size when FERRY_BATCH_MAX_SIZE is unset: derived from what its worker learns.

As many jobs of the usual cost as make a batch worth its fixed cost
(BATCH_KNEE x intercept / slope of the latency fit), within the cost cap and
what the memory budget admits, between the floor and the ceiling.
"""

from __future__ import annotations

import math

import pytest

from scheduler import Batcher, PendingItem, PolicyKind
from scheduler.learning import BATCH_KNEE, SchedulerState, Tuning, derived_batch_size
from scheduler.policy import INF, LinearFit
from scheduler.vocabulary import BATCH_SIZE_CEILING, BATCH_SIZE_FLOOR

# The simulator's padded GPU: 2 ms per batch and 1 us per padded token, so a
# batch is worth 4 x 2,000 = 8,000 tokens.
GPU = LinearFit(0.002, 1e-6)


@pytest.mark.parametrize(
    ("latency", "work_cap", "item_cost", "expected"),
    [
        (GPU, INF, 50.0, 160),  # 8,000 tokens of 50-token jobs
        (GPU, INF, 100.0, 80),
        (GPU, INF, 31.0, 256),  # 258 would fit: the ceiling
        (GPU, INF, 400.0, 32),  # 20 would fit: the floor
        (GPU, 4000.0, 50.0, 80),  # the cost cap or the memory binds first
        (GPU, INF, 0.0, 256),  # a cost below one counts as one
        (GPU, 100.0, 1.0, 100),  # ... and a cost of one as itself
        (GPU, 150.0, 1.5, 100),
        (LinearFit(0.0, 1e-6), INF, 10.0, 32),  # no fixed cost (a CPU): nothing to amortise
        (LinearFit(0.002, 0.0), INF, 10.0, 256),  # every batch costs the same: fill it
        (LinearFit(0.002, 0.0), 1000.0, 10.0, 100),
        (LinearFit(), INF, 10.0, 32),  # nothing known yet
    ],
)
def test_the_derived_size(
    latency: LinearFit, work_cap: float, item_cost: float, expected: int
) -> None:
    assert derived_batch_size(latency, work_cap, item_cost) == expected


def test_the_knee_is_where_the_fixed_cost_is_a_quarter_of_the_work() -> None:
    # 2,000 tokens worth of fixed cost: the batch is worth BATCH_KNEE times that.
    assert derived_batch_size(GPU, INF, 1.0) == BATCH_SIZE_CEILING
    size = derived_batch_size(GPU, INF, 2000.0 * BATCH_KNEE / 100)
    assert size == 100
    assert BATCH_SIZE_FLOOR < size < BATCH_SIZE_CEILING


def test_the_state_derives_it_from_its_fits_and_the_usual_cost() -> None:
    state = SchedulerState.create(Tuning(padded=True), latency_prior=GPU)
    for _ in range(200):
        state.observe_arrival(50)
    assert state.mean_cost == pytest.approx(50.0)
    assert state.max_batch_size == 160
    profile = state.profile(0.0)
    assert profile.max_batch_size == 160
    assert profile.bulk_slots == math.ceil(0.05 * 160)


def test_the_memory_budget_caps_the_derived_size() -> None:
    # 1 byte per unit of work, 5,000 bytes at the 0.8 threshold: 5,000 work, 100 jobs of 50.
    tuning = Tuning(memory_budget_bytes=6250.0, memory_threshold=0.8)
    state = SchedulerState.create(tuning, latency_prior=GPU, memory_prior=LinearFit(0.0, 1.0))
    state.observe_arrival(50)
    assert state.max_batch_size == 100
    state.observe_oom(2500.0)  # the ceiling falls to 0.9 x 2,500 bytes: 45 jobs
    assert state.max_batch_size == 45
    state.observe_oom(1000.0)  # 900 bytes: 18 jobs, below the floor
    assert state.max_batch_size == BATCH_SIZE_FLOOR


def test_the_cost_cap_caps_the_derived_size() -> None:
    state = SchedulerState.create(Tuning(batch_max_cost=3000), latency_prior=GPU)
    state.observe_arrival(50)
    assert state.max_batch_size == 60


def test_a_size_that_is_set_is_kept() -> None:
    state = SchedulerState.create(Tuning(batch_max_size=8), latency_prior=GPU)
    state.observe_arrival(1)
    assert state.max_batch_size == 8 == state.profile(0.0).max_batch_size
    assert Tuning(batch_max_size=8).most_batch_items == 8
    assert Tuning().most_batch_items == BATCH_SIZE_CEILING  # a worker holds a full batch


def test_a_batch_of_short_jobs_grows_past_the_floor() -> None:
    """What the derived size is for: 100 short jobs pending run as one batch, not 32."""
    batcher: Batcher[int] = Batcher(
        SchedulerState.create(Tuning(padded=True, bulk_share=0.0), latency_prior=GPU)
    )
    for i in range(100):
        batcher.add(PendingItem(str(i), "normal", 20, 0.0, 1.0), i, 0.0)
    decision = batcher.schedule(0.0)
    assert len(decision.run) == 100


def test_fixed_batching_keeps_its_usual_size_when_unset() -> None:
    batcher: Batcher[int] = Batcher(SchedulerState.create(Tuning()), PolicyKind.FIXED, 0.005)
    for i in range(40):
        batcher.add(PendingItem(str(i), "normal", 20, 0.0), i, 0.0)
    assert len(batcher.schedule(0.0).run) == BATCH_SIZE_FLOOR
