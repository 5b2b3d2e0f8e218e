"""The circuit breaker's levels (api/breaker.py) and the p99 the workers publish for it."""

from __future__ import annotations

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


def test_it_opens_at_once_and_closes_a_level_per_cool_period_of_calm() -> None:
    clock = Clock()
    breaker = Breaker(BreakerPolicy(cool_s=5.0), clock=clock)
    assert breaker.update("m", load(900))[0] == 2
    clock.now = 1.0
    assert breaker.update("m", load(10))[0] == 2  # calm from now
    clock.now = 5.9
    assert breaker.update("m", load(10))[0] == 2
    clock.now = 6.0
    assert breaker.update("m", load(10))[0] == 1
    clock.now = 10.9
    assert breaker.update("m", load(10))[0] == 1
    clock.now = 11.0
    assert breaker.update("m", None)[0] == 0  # nothing published any more: it closes too
    clock.now = 12.0
    assert breaker.update("m", load(500))[0] == 1  # and opens again at once


def test_a_storm_in_the_calm_starts_the_cool_period_over() -> None:
    clock = Clock()
    breaker = Breaker(BreakerPolicy(cool_s=5.0), clock=clock)
    breaker.update("m", load(500))
    clock.now = 1.0
    breaker.update("m", load(10))
    clock.now = 4.0
    assert breaker.update("m", load(500))[0] == 1
    clock.now = 8.0
    assert breaker.update("m", load(10))[0] == 1
    clock.now = 12.9
    assert breaker.update("m", load(10))[0] == 1
    clock.now = 13.0
    assert breaker.update("m", load(10))[0] == 0


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
