"""A padded model's batch: a band of similar costs, held to the efficiency floor.

Every input is padded to the batch's longest, so the batch is a cost band
around the head's cost (the first item in order): the band whose batch does
the most useful work per second (``sum cost / predicted latency``). While more
is pending than one batch holds, a band may not waste more than
``1 - min_efficiency`` of its work on padding; with everything fitting in one
batch the floor is off. An item that has waited half its time to its deadline
leads, whatever its lane (the urgent one aside).
"""

from __future__ import annotations

import math
import random

import pytest

from scheduler.policy import LinearFit, PendingItem, Profile, decide


def item(
    key: str,
    cost: int,
    arrival_s: float = 0.0,
    lane: str = "normal",
    deadline_s: float | None = None,
) -> PendingItem:
    return PendingItem(key, lane, cost, arrival_s=arrival_s, deadline_s=deadline_s)


def padded(**fields: object) -> Profile:
    base: dict[str, object] = {"max_batch_size": 8, "window_s": 0.0, "padded": True}
    return Profile(**{**base, **fields})  # type: ignore[arg-type]


def ran(pending: list[PendingItem], profile: Profile, now: float = 100.0) -> list[str]:
    return [i.key for i in decide(pending, profile, now).run]


# --- the band that does the most work per second ----------------------------------------


def fits(top: int, profile: Profile) -> int:
    if math.isinf(profile.max_batch_cost):
        return profile.max_batch_size
    return min(profile.max_batch_size, int(profile.max_batch_cost // top))


def best_band(pending: list[PendingItem], profile: Profile) -> set[str]:
    """Every band [low, top] around the head's cost, its batch taken in order: the fastest.

    A band is scored longest first, so one whose items above ``low`` fill the
    batch by themselves is not a band of ``low`` (the narrower band it fills is).
    """
    head, rest = pending[0], pending[1:]
    everything_fits = len(pending) <= fits(max(i.cost for i in pending), profile)
    floor = 0.0 if everything_fits else profile.min_efficiency
    costs = sorted({i.cost for i in pending})
    best = ([head], head.cost / profile.latency(head.cost))  # the head alone
    for low in (c for c in costs if c <= head.cost):
        for top in (c for c in costs if c >= head.cost):
            cap = max(1, fits(top, profile))
            if 1 + sum(low < i.cost <= top for i in rest) >= cap:
                continue
            batch = [head, *[i for i in rest if low <= i.cost <= top][: cap - 1]]
            total = sum(i.cost for i in batch)
            if total < floor * len(batch) * top:
                continue
            rate = total / profile.latency(len(batch) * top)
            if rate > best[1] * (1 + 1e-9):
                best = (batch, rate)
    return {i.key for i in best[0]}


def test_the_band_chosen_is_the_fastest_one_around_the_head() -> None:
    rng = random.Random(11)
    for case in range(400):
        head = item("head", rng.choice([4, 8, 12, 16, 24, 32, 48, 64]), arrival_s=0.0)
        # The others longest first: what a band takes in order is then what its
        # estimate counts (the longest of each cost it reaches).
        costs = sorted(
            (rng.choice([4, 8, 12, 16, 24, 32, 48, 64]) for _ in range(rng.randint(1, 14))),
            reverse=True,
        )
        pending = [head] + [item(f"i{n}", cost, arrival_s=1.0 + n) for n, cost in enumerate(costs)]
        profile = padded(
            max_batch_size=rng.randint(1, 8),
            max_batch_cost=rng.choice([math.inf, 64, 128, 256]),
            min_efficiency=rng.choice([0.0, 0.6, 0.8, 0.92]),
            latency=LinearFit(rng.uniform(1e-4, 1e-2), rng.uniform(1e-5, 1e-3)),
        )
        assert set(ran(pending, profile)) == best_band(pending, profile), case


def test_same_cost_items_run_together_while_a_batch_costs_something_fixed() -> None:
    profile = padded(latency=LinearFit(0.001, 1e-4))
    pending = [item(f"i{n}", 10, arrival_s=n) for n in range(4)]
    assert ran(pending, profile) == ["i0", "i1", "i2", "i3"]


def test_an_odd_head_runs_alone_when_padding_others_costs_more_than_it_gains() -> None:
    profile = padded(latency=LinearFit(1e-4, 1e-4))
    pending = [item("short", 10)] + [item(f"long{n}", 100, arrival_s=1.0 + n) for n in range(3)]
    assert ran(pending, profile) == ["short"]
    pending = [item("long", 100)] + [item(f"short{n}", 10, arrival_s=1.0 + n) for n in range(3)]
    assert ran(pending, profile) == ["long"]


# --- the floor --------------------------------------------------------------------------

# A fixed cost that dominates: mixing 8s with 32s is the fastest batch, at 44 % efficiency.
MIXING = LinearFit(1 / 16, 1 / 4096)


def mixed_backlog(count: int) -> list[PendingItem]:
    return [item("head", 8)] + [
        item(f"i{n}", 32 if n < 2 else 8, arrival_s=1.0 + n) for n in range(count - 1)
    ]


def test_the_floor_keeps_padding_out_while_more_is_pending_than_a_batch_holds() -> None:
    run = ran(mixed_backlog(12), padded(latency=MIXING, min_efficiency=0.5))
    assert len(run) == 8 and "i0" not in run and "i1" not in run
    # Without the floor, the mix runs.
    run = ran(mixed_backlog(12), padded(latency=MIXING, min_efficiency=0.0))
    assert {"i0", "i1"} <= set(run)


@pytest.mark.parametrize("count", [8, 5])
def test_the_floor_is_off_when_everything_pending_fits_in_one_batch(count: int) -> None:
    run = ran(mixed_backlog(count), padded(latency=MIXING, min_efficiency=0.5))
    assert len(run) == count


def test_a_band_exactly_at_the_floor_is_allowed() -> None:
    # 4 x 8 + 4 x 24 = 128 of 8 x 24 = 192 padded: two thirds, the floor itself.
    pending = [item("head", 8)] + [
        item(f"i{n}", 24 if n < 4 else 8, arrival_s=1.0 + n) for n in range(10)
    ]
    run = ran(pending, padded(latency=MIXING, min_efficiency=128 / 192))
    assert {"i0", "i1", "i2", "i3"} <= set(run) and len(run) == 8


# --- items that have waited half their time lead ------------------------------------------

BANDS = LinearFit(0.002, 1e-6)


def vip_stream_and_an_odd_normal() -> list[PendingItem]:
    vips = [item(f"v{n}", 10, arrival_s=5.0 + n * 0.01, lane="vip") for n in range(20)]
    return [*vips, item("odd", 200, arrival_s=10.0, deadline_s=12.0)]


@pytest.mark.parametrize(("now", "leads"), [(10.9, False), (11.0, True), (11.5, True)])
def test_an_item_leads_once_it_has_waited_half_its_time(now: float, leads: bool) -> None:
    run = ran(vip_stream_and_an_odd_normal(), padded(latency=BANDS), now)
    assert (run[0] == "odd") is leads
    if not leads:
        assert "odd" not in run  # its cost matches no band of the vip lane's


def test_the_earliest_deadline_leads_among_the_items_due() -> None:
    pending = [
        *vip_stream_and_an_odd_normal(),
        item("odder", 300, arrival_s=10.0, deadline_s=11.8),
    ]
    assert ran(pending, padded(latency=BANDS), 11.0)[0] == "odder"


def test_an_urgent_head_leads_even_over_an_item_due() -> None:
    pending = [item("u", 10, arrival_s=10.5, lane="urgent"), *vip_stream_and_an_odd_normal()]
    run = ran(pending, padded(latency=BANDS), 11.0)
    assert run[0] == "u"


def test_whether_an_item_can_still_finish_is_judged_on_its_own_cost_alone() -> None:
    # Alone, 10 units take 0.1 s: with 0.15 s left it can still make its deadline.
    pending = [item("a", 10, deadline_s=100.15)]
    decision = decide(pending, padded(latency=LinearFit(0.0, 0.01)), now=100.0)
    assert decision.expire == () and [i.key for i in decision.run] == ["a"]


def test_a_head_of_the_longest_cost_takes_shorter_items_along_when_that_is_faster() -> None:
    pending = [item("head", 32), item("a", 32, 1.0), item("b", 16, 2.0), item("c", 16, 3.0)]
    assert ran(pending, padded(latency=LinearFit(0.01, 1e-5))) == ["head", "a", "b", "c"]
