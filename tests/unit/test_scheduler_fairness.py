"""Tenants in turn: the order the scheduler takes pending items in when several tenants wait."""

from __future__ import annotations

import random

from scheduler.policy import LinearFit, PendingItem, Profile, decide, fair_order, order_key


def job(
    key: str,
    tenant: str,
    lane: str = "normal",
    arrival_s: float = 0.0,
    deadline_s: float | None = None,
    cost: int = 10,
    last_served: int = -1,
) -> PendingItem:
    return PendingItem(
        key=key, lane=lane, cost=cost, arrival_s=arrival_s, deadline_s=deadline_s,
        tenant=tenant, last_served=last_served,
    )  # fmt: skip


def keys(items: list[PendingItem] | tuple[PendingItem, ...]) -> list[str]:
    return [item.key for item in items]


def test_one_tenant_keeps_lane_deadline_arrival_order() -> None:
    rng = random.Random(7)
    lanes = ["urgent", "vip", "normal", "bulk"]
    items = [
        job(f"j{i}", "a", lane=rng.choice(lanes), arrival_s=rng.random(),
            deadline_s=rng.choice([None, 5 + rng.random()]), last_served=3)
        for i in range(200)
    ]  # fmt: skip
    assert keys(fair_order(items)) == keys(sorted(items, key=order_key))
    # The same with a second tenant alone in another lane (the fair path runs).
    other = [job(f"v{i}", "b", lane="vip", arrival_s=i, deadline_s=9 - i) for i in range(5)]
    mixed = [item for item in items if item.lane != "vip"] + other
    assert keys(fair_order(mixed)) == keys(sorted(mixed, key=order_key))


def test_tenants_take_turns_within_a_lane() -> None:
    flood = [job(f"f{i}", "flood", arrival_s=i * 0.01) for i in range(6)]
    other = [job("o0", "other", arrival_s=1.0), job("o1", "other", arrival_s=1.1)]
    ordered = keys(fair_order(flood + other))
    assert ordered == ["f0", "o0", "f1", "o1", "f2", "f3", "f4", "f5"]


def test_least_recently_served_tenant_first_among_equal_turns() -> None:
    flood = [job(f"f{i}", "flood", arrival_s=i * 0.01, last_served=9) for i in range(5)]
    late = job("o0", "other", arrival_s=2.0, last_served=4)
    assert keys(fair_order([*flood, late]))[:2] == ["o0", "f0"]
    never = job("n0", "new", arrival_s=3.0)  # never served: before both
    assert keys(fair_order([*flood, late, never]))[:3] == ["n0", "o0", "f0"]


def test_deadlines_do_not_put_a_backlog_ahead_of_another_tenants_first_job() -> None:
    flood = [job(f"f{i}", "flood", arrival_s=0.0, deadline_s=1.0 + i) for i in range(5)]
    other = job("o0", "other", arrival_s=0.5, last_served=-1)
    ordered = keys(fair_order([*flood, other]))
    assert ordered.index("o0") <= 1
    # Within the flooding tenant, still the earliest deadline first.
    assert [k for k in ordered if k.startswith("f")] == ["f0", "f1", "f2", "f3", "f4"]


def test_a_higher_lane_still_goes_first_whoever_sent_it() -> None:
    items = [job("n0", "a"), job("v0", "b", lane="vip"), job("u0", "a", lane="urgent")]
    assert keys(fair_order(items)) == ["u0", "v0", "n0"]


def test_a_flooded_worker_runs_another_tenants_job_in_the_next_batch() -> None:
    prof = Profile(max_batch_size=8, window_s=0.05, latency=LinearFit(0.01, 0.001))
    flood = [job(f"f{i}", "flood", arrival_s=i * 0.001, last_served=0) for i in range(120)]
    other = job("o0", "other", arrival_s=0.5)
    decision = decide([*flood, other], prof, now=0.6)
    assert "o0" in keys(decision.run)
    assert len(decision.run) == 8


def test_padded_model_lets_the_other_tenant_lead_a_batch_within_two() -> None:
    """A padded batch is a cost band around its head: an odd cost leads its own batch."""
    prof = Profile(max_batch_size=4, window_s=0.0, padded=True, latency=LinearFit(0.01, 1e-4))
    flood = [job(f"f{i}", "flood", arrival_s=0.0, cost=10) for i in range(40)]
    other = job("o0", "other", arrival_s=0.1, cost=200)
    pending = [*flood, other]
    served: dict[str, int] = {}
    for batch in range(2):
        marked = [
            PendingItem(**{**vars(item), "last_served": served.get(item.tenant, -1)})
            for item in pending
        ]
        run = decide(marked, prof, now=1.0).run
        if "o0" in keys(run):
            break
        for item in run:
            served[item.tenant] = batch
        done = set(keys(run))
        pending = [item for item in pending if item.key not in done]
    else:
        raise AssertionError("the other tenant's job did not run in the first two batches")
