"""The circuit breaker's levels (api/breaker.py) and the p99 the workers publish for it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from api.breaker import Breaker, BreakerPolicy, Load
from workers.gpu.learned import RecentLatencies


def load(p99_ms: float = 0.0, memory: float | None = None, lane: str = "normal") -> Load:
    return Load({lane: p99_ms}, latency_target_ms=100.0, memory_fraction=memory)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("signal", "level"),
    [
        (load(399), 0),
        (load(401), 1),
        (load(801), 2),
        (load(5000, lane="bulk"), 0),  # bulk's own latency is what bulk is for
        (load(401, lane="urgent"), 1),
        (load(0, memory=0.91), 1),
        (load(0, memory=0.96), 2),
        (load(401, memory=0.96), 2),
    ],
)
def test_the_level_is_set_by_interactive_latency_against_the_target_or_by_memory(
    signal: Load, level: int
) -> None:
    assert BreakerPolicy(latency_factor=4.0, memory_fraction=0.9).level(signal)[0] == level


def test_it_sheds_bulk_then_normal_never_urgent_and_says_why() -> None:
    breaker = Breaker(BreakerPolicy(), clock=Clock())
    assert breaker.sheds("m", "bulk", load(100)) is None
    why = breaker.sheds("m", "bulk", load(450))
    assert why == "its p99 latency is 450 ms, over 4x its target of 100 ms"
    assert breaker.sheds("m", "normal", load(450)) is None
    assert breaker.sheds("m", "normal", load(900)) is not None
    assert breaker.sheds("m", "urgent", load(900)) is None
    assert breaker.sheds("m", "vip", load(900)) is None
    assert breaker.sheds("other", "bulk", None) is None  # each model its own


def levels_on_a_clock(cool_s: float) -> Callable[[float, Load | None], int]:
    """A breaker on a clock of its own: ``level_at(now, load)`` updates model m's level with
    ``load`` at ``now`` and returns it."""
    clock = Clock()
    breaker = Breaker(BreakerPolicy(cool_s=cool_s), clock=clock)

    def level_at(now: float, signal: Load | None) -> int:
        clock.now = now
        return breaker.update("m", signal)[0]

    return level_at


def test_it_opens_at_once_and_closes_a_level_per_cool_period_of_calm() -> None:
    level_at = levels_on_a_clock(cool_s=5.0)
    assert level_at(0.0, load(900)) == 2
    assert level_at(1.0, load(10)) == 2  # calm from now
    assert level_at(5.9, load(10)) == 2
    assert level_at(6.0, load(10)) == 1
    assert level_at(10.9, load(10)) == 1
    assert level_at(11.0, None) == 0  # nothing published any more: it closes too
    assert level_at(12.0, load(500)) == 1  # and opens again at once


def test_a_storm_in_the_calm_starts_the_cool_period_over() -> None:
    level_at = levels_on_a_clock(cool_s=5.0)
    level_at(0.0, load(500))
    level_at(1.0, load(10))
    assert level_at(4.0, load(500)) == 1
    assert level_at(8.0, load(10)) == 1
    assert level_at(12.9, load(10)) == 1
    assert level_at(13.0, load(10)) == 0


def test_the_published_p99_is_of_the_window_by_lane() -> None:
    recent = RecentLatencies(window_s=10.0)
    recent.add(0.0, ["normal"] * 100, [i / 1000.0 for i in range(1, 101)])
    recent.add(5.0, ["urgent", "urgent"], [0.002, 0.004])
    assert recent.p99_ms(("urgent", "normal", "bulk")) == {
        "urgent": 4.0,
        "normal": 99.0,
        "bulk": 0.0,
    }
    assert not recent.expire(10.0)
    assert recent.expire(10.5)
    assert recent.p99_ms(("urgent", "normal")) == {"urgent": 4.0, "normal": 0.0}
