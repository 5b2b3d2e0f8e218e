"""The batching policy: a pure function of (pending items, profile, now)."""

from __future__ import annotations

import pytest

from scheduler.policy import BatchDecision, PendingItem, Profile, decide, order_key


def item(
    key: str,
    lane: str = "normal",
    arrival_s: float = 0.0,
    deadline_s: float | None = None,
    cost: int = 1,
) -> PendingItem:
    return PendingItem(key=key, lane=lane, cost=cost, arrival_s=arrival_s, deadline_s=deadline_s)


def keys(items: tuple[PendingItem, ...]) -> list[str]:
    return [i.key for i in items]


# --- Profile -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_batch_size", "window_s", "message"),
    [
        (0, 0.01, "max_batch_size"),
        (-3, 0.01, "max_batch_size"),
        (4, -0.001, "window_s"),
        (4, -1.0, "window_s"),
    ],
)
def test_profile_rejects_invalid_limits(max_batch_size: int, window_s: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Profile(max_batch_size=max_batch_size, window_s=window_s)


@pytest.mark.parametrize(("max_batch_size", "window_s"), [(1, 0.0), (1, 0.5), (4096, 10.0)])
def test_profile_accepts_valid_limits(max_batch_size: int, window_s: float) -> None:
    profile = Profile(max_batch_size=max_batch_size, window_s=window_s)
    assert (profile.max_batch_size, profile.window_s) == (max_batch_size, window_s)


# --- order_key ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        # Lane first, whatever the arrival and deadline.
        (
            [
                item("b", "bulk", arrival_s=0.0, deadline_s=1.0),
                item("n", "normal", arrival_s=1.0),
                item("v", "vip", arrival_s=2.0),
                item("u", "urgent", arrival_s=3.0),
            ],
            ["u", "v", "n", "b"],
        ),
        # Same lane: the earliest deadline first; no deadline sorts last.
        (
            [
                item("none", arrival_s=0.0),
                item("late", arrival_s=1.0, deadline_s=50.0),
                item("soon", arrival_s=2.0, deadline_s=10.0),
            ],
            ["soon", "late", "none"],
        ),
        # Same lane and deadline: arrival order.
        (
            [
                item("third", arrival_s=3.0, deadline_s=9.0),
                item("first", arrival_s=1.0, deadline_s=9.0),
                item("second", arrival_s=2.0, deadline_s=9.0),
            ],
            ["first", "second", "third"],
        ),
        # Same lane, no deadlines: arrival order.
        ([item("y", arrival_s=2.0), item("x", arrival_s=1.0)], ["x", "y"]),
    ],
)
def test_order_key_sorts_lane_then_deadline_then_arrival(
    items: list[PendingItem], expected: list[str]
) -> None:
    assert [i.key for i in sorted(items, key=order_key)] == expected


def test_order_key_rejects_unknown_lane() -> None:
    with pytest.raises(KeyError):
        order_key(item("x", lane="platinum"))


# --- decide: triggers -------------------------------------------------------


def test_empty_input_waits_for_work() -> None:
    assert decide([], Profile(max_batch_size=4, window_s=0.01), now=100.0) == BatchDecision()
    decision = decide(iter([]), Profile(max_batch_size=4, window_s=0.01), now=100.0)
    assert decision.run == ()
    assert decision.expire == ()
    assert decision.wait_s is None
    assert decision.trigger is None


@pytest.mark.parametrize(
    ("pending", "profile", "now", "trigger", "run"),
    [
        # Size: as many items as the batch holds, none has waited the window.
        (
            [item("a", arrival_s=10.0), item("b", arrival_s=10.001)],
            Profile(max_batch_size=2, window_s=1.0),
            10.002,
            "size",
            ["a", "b"],
        ),
        # Size with more items than fit: capped.
        (
            [item(str(n), arrival_s=10.0 + n / 1000) for n in range(5)],
            Profile(max_batch_size=3, window_s=1.0),
            10.01,
            "size",
            ["0", "1", "2"],
        ),
        # Time: the oldest waited exactly the window.
        (
            [item("a", arrival_s=10.0), item("b", arrival_s=10.4)],
            Profile(max_batch_size=8, window_s=0.5),
            10.5,
            "time",
            ["a", "b"],
        ),
        # Time: the oldest waited longer than the window.
        (
            [item("a", arrival_s=10.0)],
            Profile(max_batch_size=8, window_s=0.5),
            12.0,
            "time",
            ["a"],
        ),
        # Urgent: one urgent item dispatches at once, taking the others along.
        (
            [item("n", arrival_s=10.0), item("u", "urgent", arrival_s=10.1)],
            Profile(max_batch_size=8, window_s=5.0),
            10.1,
            "urgent",
            ["u", "n"],
        ),
        # Urgent wins over size when both hold.
        (
            [item("n", arrival_s=10.0), item("u", "urgent", arrival_s=10.1)],
            Profile(max_batch_size=2, window_s=5.0),
            10.1,
            "urgent",
            ["u", "n"],
        ),
        # Window 0: a lone item dispatches the moment it arrives.
        (
            [item("a", arrival_s=10.0)],
            Profile(max_batch_size=8, window_s=0.0),
            10.0,
            "time",
            ["a"],
        ),
    ],
)
def test_triggers(
    pending: list[PendingItem], profile: Profile, now: float, trigger: str, run: list[str]
) -> None:
    decision = decide(pending, profile, now)
    assert decision.trigger == trigger
    assert keys(decision.run) == run
    assert decision.expire == ()
    assert decision.wait_s is None


@pytest.mark.parametrize(
    ("arrivals", "window_s", "now", "wait_s"),
    [
        ([10.0], 0.5, 10.0, 0.5),
        ([10.0], 0.5, 10.2, 0.3),
        ([10.3, 10.0, 10.2], 0.5, 10.4, 0.1),  # the oldest counts, not the first listed
        ([10.0, 10.49], 0.5, 10.49, 0.01),
    ],
)
def test_no_trigger_waits_until_the_oldest_has_waited_the_window(
    arrivals: list[float], window_s: float, now: float, wait_s: float
) -> None:
    pending = [item(f"k{n}", arrival_s=a) for n, a in enumerate(arrivals)]
    decision = decide(pending, Profile(max_batch_size=8, window_s=window_s), now)
    assert decision.run == ()
    assert decision.trigger is None
    assert decision.expire == ()
    assert decision.wait_s == pytest.approx(wait_s)


def test_batch_capped_at_max_size_with_the_most_urgent_first() -> None:
    pending = [
        item("bulk-old", "bulk", arrival_s=0.0),
        item("normal-late-deadline", "normal", arrival_s=1.0, deadline_s=200.0),
        item("normal-no-deadline", "normal", arrival_s=0.5),
        item("vip", "vip", arrival_s=3.0),
        item("normal-early-deadline", "normal", arrival_s=2.0, deadline_s=150.0),
        item("urgent", "urgent", arrival_s=4.0),
    ]
    decision = decide(pending, Profile(max_batch_size=4, window_s=0.01), now=5.0)
    assert decision.trigger == "urgent"
    assert keys(decision.run) == [
        "urgent",
        "vip",
        "normal-early-deadline",
        "normal-late-deadline",
    ]


@pytest.mark.parametrize("size", [1, 2, 7])
def test_run_never_exceeds_max_batch_size(size: int) -> None:
    pending = [item(str(n), arrival_s=float(n)) for n in range(10)]
    decision = decide(pending, Profile(max_batch_size=size, window_s=0.0), now=100.0)
    assert len(decision.run) == size
    assert keys(decision.run) == [str(n) for n in range(size)]


# --- decide: expiry ----------------------------------------------------------


@pytest.mark.parametrize(
    ("deadline_s", "now", "expired"),
    [
        (10.0, 10.0, True),  # the deadline is now: too late
        (9.0, 10.0, True),
        (10.001, 10.0, False),
        (None, 1e9, False),
    ],
)
def test_expiry_at_or_after_the_deadline(
    deadline_s: float | None, now: float, expired: bool
) -> None:
    pending = [item("x", arrival_s=0.0, deadline_s=deadline_s)]
    decision = decide(pending, Profile(max_batch_size=8, window_s=0.0), now)
    assert keys(decision.expire) == (["x"] if expired else [])
    assert keys(decision.run) == ([] if expired else ["x"])


def test_expired_items_never_run_even_when_urgent_or_size_triggers() -> None:
    pending = [
        item("dead-urgent", "urgent", arrival_s=0.0, deadline_s=5.0),
        item("live-urgent", "urgent", arrival_s=1.0, deadline_s=50.0),
        item("dead-normal", arrival_s=0.0, deadline_s=10.0),
        item("live-normal", arrival_s=2.0),
    ]
    decision = decide(pending, Profile(max_batch_size=2, window_s=5.0), now=10.0)
    assert keys(decision.run) == ["live-urgent", "live-normal"]
    assert sorted(keys(decision.expire)) == ["dead-normal", "dead-urgent"]
    assert decision.trigger == "urgent"


def test_only_expired_items_means_nothing_to_wait_for() -> None:
    pending = [item("a", deadline_s=1.0), item("b", "urgent", deadline_s=2.0)]
    decision = decide(pending, Profile(max_batch_size=1, window_s=0.0), now=3.0)
    assert decision.run == ()
    assert sorted(keys(decision.expire)) == ["a", "b"]
    assert decision.wait_s is None
    assert decision.trigger is None


def test_expired_items_do_not_count_toward_size_or_age() -> None:
    # The expired item is the oldest and would fill the batch; neither counts.
    pending = [item("dead", arrival_s=0.0, deadline_s=9.0), item("live", arrival_s=9.8)]
    decision = decide(pending, Profile(max_batch_size=2, window_s=0.5), now=10.0)
    assert decision.run == ()
    assert keys(decision.expire) == ["dead"]
    assert decision.trigger is None
    assert decision.wait_s == pytest.approx(0.3)


def test_decide_does_not_mutate_or_drop_items() -> None:
    pending = [item(str(n), arrival_s=float(n)) for n in range(5)] + [
        item("dead", arrival_s=0.0, deadline_s=1.0)
    ]
    snapshot = list(pending)
    decision = decide(pending, Profile(max_batch_size=3, window_s=0.0), now=10.0)
    assert pending == snapshot
    # Every item is run, expired or still pending; none twice.
    seen = keys(decision.run) + keys(decision.expire)
    assert len(seen) == len(set(seen))
    assert set(seen) <= {i.key for i in pending}


@pytest.mark.parametrize(
    ("deadline_s", "now", "trigger"),
    [
        (10.2, 10.0, "deadline"),  # 0.2 s left, window 0.5 s: waiting would miss it
        (10.5, 10.0, "deadline"),  # exactly the window left
        (11.0, 10.0, None),  # room to wait for company
        (None, 10.0, None),
    ],
)
def test_deadline_shorter_than_the_window_dispatches_now(
    deadline_s: float | None, now: float, trigger: str | None
) -> None:
    profile = Profile(max_batch_size=8, window_s=0.5)
    decision = decide([item("x", arrival_s=10.0, deadline_s=deadline_s)], profile, now)
    assert decision.trigger == trigger
    assert [i.key for i in decision.run] == (["x"] if trigger else [])
    assert decision.expire == ()
