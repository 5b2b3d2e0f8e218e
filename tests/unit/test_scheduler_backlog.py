"""The backlog override: while deadlines are at stake, the efficiency floor is dropped.

Clearing everything pending is estimated as one fixed cost per batch it needs
(by size, or by the work cap) plus the per-unit cost of its work padded at the
floor's efficiency (at worst half). Once that takes at least half the slack of
the tightest non-urgent deadline, a backlog clears fastest without the floor.

Times and costs here are powers of two, so the estimate is exact.
"""

from __future__ import annotations

import math

import pytest

from scheduler.policy import LinearFit, PendingItem, Profile, decide

FIT = LinearFit(1 / 16, 1 / 4096)  # a fixed cost that makes mixing 8s and 32s the fastest
NOW = 1.0
# 12 items of 144 units: 2 batches of 8, 144 / 0.5 = 288 padded units:
# 2 / 16 + 288 / 4096 = 0.1953125 s to clear, half the slack from 0.390625 s.
PRESSED_SLACK = 0.390625


def backlog(deadline_s: float, lane: str = "normal") -> list[PendingItem]:
    head = PendingItem("head", lane, 8, arrival_s=NOW, deadline_s=deadline_s)
    return [head] + [
        PendingItem(f"i{n}", "normal", 32 if n < 2 else 8, arrival_s=NOW - 1.0 + n / 64)
        for n in range(11)
    ]


def mixed(pending: list[PendingItem], max_batch_cost: float) -> bool:
    """Whether the batch padded the 8s to the 32s (the floor of 0.5 forbids it)."""
    profile = Profile(
        max_batch_size=8, window_s=0.0, padded=True, latency=FIT, min_efficiency=0.5,
        max_batch_cost=max_batch_cost,
    )  # fmt: skip
    run = {i.key for i in decide(pending, profile, NOW).run}
    assert "head" in run and len(run) == 8
    return {"i0", "i1"} <= run


@pytest.mark.parametrize("max_batch_cost", [math.inf, 256])
@pytest.mark.parametrize(
    ("slack_s", "pressed"),
    [
        (PRESSED_SLACK, True),
        (PRESSED_SLACK / 2, True),
        (PRESSED_SLACK + 1e-6, False),
        (10.0, False),
    ],
)
def test_the_floor_is_dropped_once_the_backlog_takes_half_the_slack(
    slack_s: float, pressed: bool, max_batch_cost: float
) -> None:
    assert mixed(backlog(NOW + slack_s), max_batch_cost) is pressed


def test_an_urgent_jobs_deadline_does_not_press() -> None:
    assert not mixed(backlog(NOW + PRESSED_SLACK / 2, lane="urgent"), math.inf)
