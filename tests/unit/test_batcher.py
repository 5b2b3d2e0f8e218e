"""The Batcher: a worker's pending items, the tenants' turns and the learned state, no clock."""

from __future__ import annotations

import math

import pytest

from scheduler import Batcher, Lane, PendingItem, PolicyKind, Trigger
from scheduler.learning import BatchObservation, SchedulerState, Tuning
from scheduler.policy import LinearFit
from scheduler.vocabulary import LANES, batch_work, work_of


def item(
    key: str, lane: str = Lane.NORMAL, cost: int = 1, at: float = 0.0, **kw: object
) -> PendingItem:
    return PendingItem(key=key, lane=lane, cost=cost, arrival_s=at, **kw)  # type: ignore[arg-type]


def batcher(kind: PolicyKind = PolicyKind.FERRY, **tuning: object) -> Batcher[str]:
    state = SchedulerState.create(
        Tuning(**tuning),  # type: ignore[arg-type]
        latency_prior=LinearFit(0.010, 0.0),  # a batch takes 10 ms, whatever its size
    )
    return Batcher(state, kind, fixed_max_delay_s=0.005)


def test_an_item_is_held_once_and_its_arrival_learned_once() -> None:
    b = batcher()
    assert b.add(item("a", cost=5), "entry-a", now=1.0)
    assert not b.add(item("a", cost=5), "entry-a again", now=1.1)
    assert len(b) == 1 and "a" in b
    assert b.payloads() == ["entry-a"]
    assert b.state.arrived_cost == 5


def test_a_full_batch_runs_and_leaves_with_its_payloads_in_order() -> None:
    b = batcher(batch_max_size=3)
    for n in range(5):
        b.add(item(f"k{n}", at=n * 0.001), f"p{n}", now=0.01)
    decision = b.schedule(0.01)
    assert decision.trigger is Trigger.SIZE
    assert b.started(decision) == ["p0", "p1", "p2"]
    assert sorted(b.pending()) == ["k3", "k4"]


def test_while_the_device_is_busy_only_a_batch_that_cannot_grow_is_prepared_ahead() -> None:
    b = batcher(batch_max_size=4, batch_window_min_ms=20.0, batch_window_max_ms=20.0)
    b.add(item("a", at=0.0), "a", now=0.0)
    b.state.window_s = 0.020
    b.state.last_batch_end_s = 0.0  # not idle: the window applies
    # Underfull: by the time the device is free it will have waited long
    # enough, but it might still grow; the caller lands the batch and asks again.
    assert not b.schedule(0.001, busy_until=0.050).run
    # Now full: it is prepared while the device computes.
    for key in "bcd":
        b.add(item(key, at=0.001), key, now=0.001)
    ahead = b.schedule(0.001, busy_until=0.050)
    assert ahead.trigger is Trigger.SIZE and len(ahead.run) == 4


def test_expiry_is_never_decided_ahead_of_time() -> None:
    b = batcher(batch_max_size=2)
    b.add(item("late", at=0.0, deadline_s=0.015), "late", now=0.0)
    b.add(item("x", at=0.0), "x", now=0.0)
    b.add(item("y", at=0.0), "y", now=0.0)
    # At the device's free time the first would be expired: ahead, nothing expires.
    ahead = b.schedule(0.0, busy_until=0.020)
    assert ahead.expire == ()
    now = b.schedule(0.020)
    assert [i.key for i in now.expire] == ["late"]
    assert b.expired(now) == ["late"] and "late" not in b


def test_tenants_take_turns_across_batches() -> None:
    b = batcher(batch_max_size=1)
    for n in range(3):
        b.add(item(f"a{n}", at=0.0, tenant="a"), f"a{n}", now=0.0)
    b.add(item("b0", at=0.5, tenant="b"), "b0", now=0.5)
    served = [b.started(b.schedule(1.0))[0] for _ in range(4)]
    # b's only job does not wait behind a's backlog.
    assert served.index("b0") <= 1
    assert sorted(served) == ["a0", "a1", "a2", "b0"]


def test_only_runnable_items_are_scheduled() -> None:
    b = batcher(batch_max_size=8)
    b.add(item("mine"), "v1", now=0.0)
    b.add(item("pinned"), "v2", now=0.0)
    decision = b.schedule(1.0, runnable=lambda payload: payload == "v1")
    assert [i.key for i in decision.run] == ["mine"]
    assert b.remove(["pinned", "unknown"]) == ["v2"]


def test_a_finished_batch_and_an_out_of_memory_teach_the_state() -> None:
    b = batcher(padded=True, memory_budget_bytes=1000.0, memory_threshold=1.0)
    b.state.memory = type(b.state.memory)(LinearFit(0.0, 10.0))
    b.out_of_memory([10, 30])  # padded: work 2 x 30 = 60, predicted 600 bytes
    assert b.state.memory_ceiling == pytest.approx(600 * 0.9)
    b.finished(BatchObservation(size=2, cost=4, work=4.0, latency_s=0.02, ended_s=1.0))
    assert b.state.batches == 1


def test_a_new_versions_state_is_learned_from_and_the_pending_items_stay() -> None:
    old = batcher()
    old.add(item("a"), "a", now=0.0)
    new = batcher(PolicyKind.NONE)
    old.learn_from(new)
    assert old.state is new.state and old.kind is PolicyKind.NONE
    assert old.payloads() == ["a"]
    assert old.schedule(0.0).trigger is Trigger.SINGLE


def test_the_peers_batching_through_the_same_interface() -> None:
    fixed = batcher(PolicyKind.FIXED, batch_max_size=2)
    fixed.add(item("a", at=0.0), "a", now=0.0)
    assert fixed.schedule(0.001).wait_s == pytest.approx(0.004)
    assert fixed.schedule(0.005).trigger is Trigger.TIME
    with pytest.raises(ValueError, match="unknown scheduler"):
        batcher("fifo")  # type: ignore[arg-type]


def test_the_shared_words() -> None:
    assert [lane.rank for lane in LANES] == [0, 1, 2, 3]
    assert Lane("bulk") is Lane.BULK and Lane.URGENT == "urgent"
    assert {t for t in Trigger if t.ahead} == {
        Trigger.URGENT, Trigger.SIZE, Trigger.COST, Trigger.MEMORY, Trigger.LATENCY,
        Trigger.DEADLINE,
    }  # fmt: skip
    assert batch_work([3, 5, 1], padded=True) == 15 == work_of(3, 9, 5, padded=True)
    assert batch_work([3, 5, 1], padded=False) == 9
    assert batch_work([], padded=True) == 0
    assert math.isinf(Tuning().cost_cap)
