"""Retry-After from the per-key budget is a promise: a client that waits exactly that
long is served, and one that comes back a second sooner is still refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from limits import parse_many

from api.errors import ApiError
from api.limits import SharedBudget


class _NoSharedCounts:
    """Redis as seen by one process alone: no other process has counted anything."""

    async def mget(self, *keys: str) -> list[None]:
        return [None for _ in keys]


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _refused_after(budget: SharedBudget, clock: _Clock) -> int | None:
    try:
        asyncio.run(budget.check("key"))
    except ApiError as exc:
        return int(exc.headers["Retry-After"])
    return None


@pytest.mark.parametrize("spec", ["5/second", "1/second", "3/10 seconds", "40/minute"])
@pytest.mark.parametrize("start", [0.01, 0.3, 0.5, 0.97])
@pytest.mark.parametrize("pace", [0.0, 0.02])
def test_retry_after_is_exactly_as_long_as_the_sliding_window_refuses(
    monkeypatch: pytest.MonkeyPatch, spec: str, start: float, pace: float
) -> None:
    items = parse_many(spec)
    period = items[0].get_expiry()
    clock = _Clock(1_000_000 * period + start * period)
    monkeypatch.setattr("api.limits.time.time", clock)
    client: Any = _NoSharedCounts()
    budget = SharedBudget(client, "t", items)
    for _round in range(3):  # a burst, a wait as told, again: each wait holds
        for _ in range(items[0].amount + 2):
            retry = _refused_after(budget, clock)
            if retry is not None:
                break
            clock.now += pace
        assert retry is not None
        assert 1 <= retry <= 2 * period
        refused_at = clock.now
        clock.now = refused_at + retry - 1
        assert _refused_after(budget, clock) is not None
        clock.now = refused_at + retry
        assert _refused_after(budget, clock) is None
