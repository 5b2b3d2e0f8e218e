"""The cut after a cost or memory limit: a batch takes items until the next would cross.

A batch that reaches a limit (the cost cap, the memory ceiling, the size) is
closed: it runs now, named after that limit. One that merely left an item
out by choice (a padded model's band) still has room and waits out its window.
"""

from __future__ import annotations

import math

import pytest

from scheduler.baselines import decide_fixed
from scheduler.policy import LinearFit, PendingItem, Profile, decide

# A padded model where padding costs more than a batch's fixed cost: bands stay narrow.
NARROW = LinearFit(1e-4, 1e-4)


def item(key: str, cost: int, arrival_s: float = 0.0, lane: str = "normal") -> PendingItem:
    return PendingItem(key, lane, cost, arrival_s=arrival_s)


def costs(pending_costs: list[int], lane: str = "normal", prefix: str = "i") -> list[PendingItem]:
    return [
        item(f"{prefix}{n}", c, arrival_s=n / 64, lane=lane) for n, c in enumerate(pending_costs)
    ]


def profile(**fields: object) -> Profile:
    # A long window and a model that is not idle: only a limit makes a batch run now.
    base: dict[str, object] = {"max_batch_size": 8, "window_s": 1.0}
    return Profile(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limits", "trigger"),
    [
        ({"max_batch_cost": 100}, "cost"),
        ({"memory": LinearFit(0.0, 1e6), "memory_limit": 100e6}, "memory"),
    ],
)
def test_a_batch_may_reach_a_limit_exactly_and_is_cut_before_crossing_it(
    limits: dict[str, object], trigger: str
) -> None:
    decision = decide(costs([30, 30, 40, 1]), profile(**limits), now=0.5)
    assert [i.key for i in decision.run] == ["i0", "i1", "i2"]  # 100 of 100
    assert decision.trigger == trigger


def test_a_padded_batch_holds_what_the_cost_cap_allows_and_runs_at_once() -> None:
    decision = decide(
        costs([10] * 20), profile(max_batch_size=32, padded=True, max_batch_cost=100), now=0.5
    )
    assert len(decision.run) == 10 and decision.trigger == "cost"


def test_a_padded_batch_that_left_an_item_out_by_choice_waits() -> None:
    # The 50 would fit beside the three 10s, but padding them to it is slower.
    decision = decide(
        costs([10, 10, 10, 50]), profile(max_batch_size=4, padded=True, latency=NARROW), now=0.5
    )
    assert decision.run == () and decision.wait_s == pytest.approx(0.5)


@pytest.mark.parametrize(("tens", "closed"), [(4, False), (5, True)])
def test_a_padded_batch_is_closed_when_the_next_item_would_cross_the_cap(
    tens: int, closed: bool
) -> None:
    # Beside 4 tens, a 20 pads 5 items to 100: it fits, so the batch waits for company.
    # Beside 5 tens, it would pad 6 to 120: the batch is full.
    prof = profile(padded=True, latency=NARROW, max_batch_cost=100)
    decision = decide(costs([10] * tens + [20]), prof, now=0.5)
    assert len(decision.run) == (tens if closed else 0)
    assert decision.trigger == ("cost" if closed else None)


def test_a_bulk_backlog_alone_is_cut_by_the_cap_too() -> None:
    prof = profile(max_batch_size=16, padded=True, latency=NARROW, max_batch_cost=100)
    decision = decide(costs([10] * 9 + [20], lane="bulk"), prof, now=0.5)
    assert len(decision.run) == 9 and decision.trigger == "cost"


def test_the_reserved_bulk_slot_fills_a_padded_batch_the_next_item_cannot_join() -> None:
    prof = profile(max_batch_size=16, padded=True, latency=NARROW, max_batch_cost=100, bulk_slots=1)
    pending = costs([10] * 9 + [20]) + costs([10], lane="bulk", prefix="b")
    decision = decide(pending, prof, now=0.5)
    assert sorted(i.key for i in decision.run) == sorted([f"i{n}" for n in range(9)] + ["b0"])
    assert decision.trigger == "cost"


def test_a_padded_batch_the_reserved_bulk_slots_fill_is_full() -> None:
    prof = profile(padded=True, bulk_slots=2)
    pending = costs([10] * 6) + costs([10] * 5, lane="bulk", prefix="b")
    decision = decide(pending, prof, now=0.5)
    assert [i.lane for i in decision.run] == ["normal"] * 6 + ["bulk"] * 2
    assert decision.trigger == "size"


@pytest.mark.parametrize(
    ("max_batch_s", "max_work"), [(0.4, 0.0), (0.5, math.inf), (0.6, math.inf)]
)
def test_with_a_flat_latency_a_limit_below_its_fixed_cost_admits_no_work(
    max_batch_s: float, max_work: float
) -> None:
    assert profile(latency=LinearFit(0.5, 0.0), max_batch_s=max_batch_s).max_work == max_work


def test_the_predicted_latency_is_that_of_the_padded_work() -> None:
    prof = profile(window_s=0.0, padded=True, latency=LinearFit(0.002, 1e-4))
    decision = decide([item("a", 10), item("b", 30)], prof, now=0.5)
    assert decision.predicted_s == pytest.approx(0.002 + 1e-4 * 2 * 30)


def test_a_deadline_closes_a_batch_only_when_the_rest_of_the_window_would_miss_it() -> None:
    # Waited 0.2 s of a 0.5 s window: 0.3 s to go, and 0.4 s of slack left.
    pending = [PendingItem("a", "normal", 1, arrival_s=10.0, deadline_s=10.6)]
    decision = decide(pending, profile(window_s=0.5), now=10.2)
    assert decision.run == () and decision.wait_s == pytest.approx(0.3)
    decision = decide(pending, profile(window_s=0.5), now=10.3)  # 0.2 s to go, 0.3 s of slack
    assert decision.wait_s == pytest.approx(0.2)
    decision = decide(pending, profile(window_s=0.5), now=10.35)  # 0.15 s to go, 0.25 s left
    assert decision.wait_s == pytest.approx(0.15)


def test_the_peers_fixed_batching_dispatches_the_moment_max_size_are_waiting() -> None:
    pending = costs([1] * 32)
    full = decide_fixed(pending, 32, 0.005, now=0.5)
    assert len(full.run) == 32 and full.trigger == "size"
    assert decide_fixed(pending[:31], 32, 1.0, now=0.5).run == ()


@pytest.mark.parametrize(
    ("pending_costs", "why"),
    [
        ([10] * 5, "more of the band than it holds"),
        ([10, 10, 10, 50], "the next item is of another band"),
    ],
)
def test_a_padded_batch_full_up_to_the_reserved_slots_is_closed_by_size(
    pending_costs: list[int], why: str
) -> None:
    # One slot of four is kept for bulk, whose one job is too long to be worth padding to.
    prof = profile(max_batch_size=4, padded=True, latency=NARROW, bulk_slots=1)
    pending = costs(pending_costs) + costs([200], lane="bulk", prefix="b")
    decision = decide(pending, prof, now=0.5)
    assert [i.key for i in decision.run] == ["i0", "i1", "i2"], why
    assert decision.trigger == "size", why
