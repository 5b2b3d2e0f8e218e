"""The first batching policy: size, time, deadline and urgent triggers, lanes in order.

The worker keeps a local set of pending items and asks :func:`decide` what to
do with them; it applies the returned :class:`BatchDecision` and asks again.
Times are seconds on one clock chosen by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

LANE_ORDER = {"urgent": 0, "vip": 1, "normal": 2, "bulk": 3}


@dataclass(frozen=True)
class PendingItem:
    """One job waiting in a worker."""

    key: str  # the caller's handle (the stream entry id)
    lane: str  # urgent | vip | normal | bulk
    cost: int
    arrival_s: float  # when the job was accepted
    deadline_s: float | None = None  # when it must have finished, if ever


@dataclass(frozen=True)
class Profile:
    """A model's batching limits."""

    max_batch_size: int
    window_s: float  # how long the oldest item may wait for company

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if not self.window_s >= 0:  # also refuses NaN
            raise ValueError("window_s must be a non-negative number")


@dataclass(frozen=True)
class BatchDecision:
    """What the worker should do now.

    ``run``: the items to run as one batch now, in order (empty: run nothing).
    ``expire``: items whose deadline has passed; end them without running.
    ``wait_s``: when nothing runs, how long until the policy should be asked
    again even if nothing new arrives (``None``: nothing pending, wait for work).
    ``trigger``: why the batch was dispatched (``urgent``, ``size``, ``deadline``,
    ``time``).
    """

    run: tuple[PendingItem, ...] = ()
    expire: tuple[PendingItem, ...] = ()
    wait_s: float | None = None
    trigger: str | None = None


def order_key(item: PendingItem) -> tuple[int, float, float]:
    """Lane first, then earliest deadline, then arrival."""
    deadline = item.deadline_s if item.deadline_s is not None else float("inf")
    return (LANE_ORDER[item.lane], deadline, item.arrival_s)


def decide(pending: Iterable[PendingItem], profile: Profile, now: float) -> BatchDecision:
    expire: list[PendingItem] = []
    live: list[PendingItem] = []
    for item in pending:
        if item.deadline_s is not None and item.deadline_s <= now:
            expire.append(item)
        else:
            live.append(item)
    if not live:
        return BatchDecision(expire=tuple(expire))

    live.sort(key=order_key)
    batch = tuple(live[: profile.max_batch_size])
    trigger = _trigger(live, profile, now)
    if trigger is not None:
        return BatchDecision(run=batch, expire=tuple(expire), trigger=trigger)

    oldest = min(item.arrival_s for item in live)
    wait_s = max(0.0, oldest + profile.window_s - now)
    return BatchDecision(expire=tuple(expire), wait_s=wait_s)


def _trigger(live: Sequence[PendingItem], profile: Profile, now: float) -> str | None:
    if any(item.lane == "urgent" for item in live):
        return "urgent"
    if len(live) >= profile.max_batch_size:
        return "size"
    # Waiting out the window would make a job miss its deadline: go now.
    deadlines = [item.deadline_s for item in live if item.deadline_s is not None]
    if deadlines and min(deadlines) - now <= profile.window_s:
        return "deadline"
    if now - min(item.arrival_s for item in live) >= profile.window_s:
        return "time"
    return None
