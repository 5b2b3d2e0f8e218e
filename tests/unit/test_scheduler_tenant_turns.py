"""The Batcher's memory of whose turn it is: least recently served first, bounded.

Each tenant is remembered by the number of the batch that last ran one of
its jobs; a tenant with nothing pending may be forgotten once more than
``2 x pending + 1000`` tenants are remembered, and comes back as never served.
"""

from __future__ import annotations

import pytest

from scheduler import Batcher, PendingItem, PolicyKind
from scheduler.learning import SchedulerState, Tuning
from scheduler.policy import LinearFit


def batcher(kind: PolicyKind = PolicyKind.FERRY, size: int = 1) -> Batcher[str]:
    state = SchedulerState.create(Tuning(batch_max_size=size), latency_prior=LinearFit(0.01, 0.0))
    return Batcher(state, kind)


def add(b: Batcher[str], key: str, tenant: str, arrival_s: float) -> None:
    b.add(PendingItem(key, "normal", 1, arrival_s=arrival_s, tenant=tenant), key, now=arrival_s)


def run_one(b: Batcher[str], now: float = 10.0) -> str:
    decision = b.schedule(now, runnable=lambda payload: payload != "held")
    (payload,) = b.started(decision)
    return payload


def test_the_tenant_served_least_recently_goes_first() -> None:
    b = batcher()
    # Each tenant's second job arrived in the reverse order of the tenants' first ones.
    for key, tenant, arrival_s in [
        ("a0", "a", 0.0), ("b0", "b", 0.1), ("c0", "c", 0.2),
        ("a1", "a", 0.5), ("b1", "b", 0.4), ("c1", "c", 0.3),
    ]:  # fmt: skip
        add(b, key, tenant, arrival_s)
    assert [run_one(b) for _ in range(6)] == ["a0", "b0", "c0", "a1", "b1", "c1"]


@pytest.mark.parametrize(
    ("served", "holding", "forgotten"),
    [(1000, False, False), (1001, False, True), (1002, True, False), (1003, True, True)],
)
def test_tenants_with_nothing_pending_are_forgotten_past_a_thousand(
    served: int, holding: bool, forgotten: bool
) -> None:
    b = batcher()
    if holding:  # one job pending throughout, of a tenant never served
        add(b, "held", "w", 0.0)
    for n in range(served):
        add(b, f"t{n}", f"t{n}", 1.0)
        assert run_one(b) == f"t{n}"
    # The first two tenants come back, the second one's job first. Remembered, the
    # first goes first (it was served longer ago); forgotten, both are new: arrival decides.
    add(b, "x", "t0", 5.1)
    add(b, "y", "t1", 5.0)
    assert [run_one(b), run_one(b)] == (["y", "x"] if forgotten else ["x", "y"])


def test_the_fixed_batching_waits_five_milliseconds_by_default() -> None:
    b = batcher(PolicyKind.FIXED, size=8)
    add(b, "a", "t", 0.0)
    assert b.schedule(0.001).wait_s == pytest.approx(0.004)
