"""The desired-workers signal: utilisation below its target, the queue drained in time,
up at once and down only after the cool-down."""

from __future__ import annotations

import pytest

from core.ops.autoscale import Demand, DesiredWorkers, workers_needed


@pytest.mark.parametrize(
    ("arrival", "backlog", "mu", "horizon", "target", "needed"),
    [
        # Steady state: lambda / (target * mu).
        (70.0, 0, 100.0, 60.0, 0.7, 1.0),
        (140.0, 0, 100.0, 60.0, 0.7, 2.0),
        (100.0, 0, 100.0, 60.0, 0.5, 2.0),
        (0.0, 0, 100.0, 60.0, 0.7, 0.0),
        # The queue must drain before the nearest deadline: backlog / (mu * H).
        (0.0, 600, 100.0, 60.0, 0.7, 0.1),
        (0.0, 600, 100.0, 2.0, 0.7, 3.0),
        (70.0, 1000, 100.0, 5.0, 0.7, 3.0),
        # Nothing learned yet: one worker to learn from, if there is any work.
        (5.0, 0, None, 60.0, 0.7, 1.0),
        (0.0, 3, None, 60.0, 0.7, 1.0),
        (0.0, 0, None, 60.0, 0.7, 0.0),
        (5.0, 0, 0.0, 60.0, 0.7, 1.0),
    ],
)
def test_workers_needed(
    arrival: float,
    backlog: int,
    mu: float | None,
    horizon: float,
    target: float,
    needed: float,
) -> None:
    assert workers_needed(Demand(arrival, backlog, mu, horizon), target) == pytest.approx(needed)


@pytest.mark.parametrize(
    ("arrival", "bulk", "mu", "needed"),
    [
        (0.0, 4096, 100.0, 1.0),  # a backfill alone: one worker, whatever its size
        (0.0, 4096, None, 1.0),
        (140.0, 4096, 100.0, 2.0),  # beside live traffic: what the live lanes need
        (0.0, 0, 100.0, 0.0),
    ],
)
def test_a_backfill_asks_for_one_worker_not_more(
    arrival: float, bulk: int, mu: float | None, needed: float
) -> None:
    demand = Demand(arrival, 0, mu, 60.0, bulk_backlog=bulk)
    assert workers_needed(demand, 0.7) == pytest.approx(needed)


def test_the_arrival_rate_is_measured_over_the_window() -> None:
    scaler = DesiredWorkers(0.7, window_s=10.0, cooldown_s=0.0)
    assert scaler.rate(0.0, 100) == 0.0  # one sample: no rate yet
    assert scaler.rate(5.0, 150) == pytest.approx(10.0)
    assert scaler.rate(10.0, 200) == pytest.approx(10.0)
    # The rate doubles: over the window (20 s back to 10 s) it reads the new rate.
    assert scaler.rate(15.0, 300) == pytest.approx(15.0)  # half old rate, half new
    assert scaler.rate(20.0, 400) == pytest.approx(20.0)
    # The counter started again (Redis lost it): measured afresh, never negative.
    assert scaler.rate(25.0, 10) == 0.0
    assert scaler.rate(30.0, 60) == pytest.approx(10.0)


def test_up_at_once_down_after_the_cooldown() -> None:
    scaler = DesiredWorkers(0.5, window_s=10.0, cooldown_s=60.0)
    mu = 10.0
    # (time, arrivals so far) at 5 jobs/s: 5 / (0.5 * 10) = 1 worker.
    steps = [(t, 5 * t) for t in range(0, 31, 5)]
    seen = [scaler.observe(t, n, 0, mu, 60.0) for t, n in steps]
    assert seen[1:] == [1] * (len(steps) - 1)
    # 20 jobs/s: 4 workers, at once (as soon as the window's rate says so).
    t, n = 30, 150
    for _ in range(4):
        t, n = t + 5, n + 100
        last = scaler.observe(t, n, 0, mu, 60.0)
    assert last == 4
    # Back to 5 jobs/s: the figure holds for the cool-down, then falls.
    held = []
    for _ in range(20):
        t, n = t + 5, n + 25
        held.append((t, scaler.observe(t, n, 0, mu, 60.0)))
    high_until = max(at for at, value in held if value == 4)
    assert 50 + 60 <= high_until <= 50 + 60 + 10 + 5  # the last 4 was needed at t=50
    assert held[-1][1] == 1
    # Never below what is needed now, and never flapping: it only steps down.
    values = [value for _, value in held]
    assert values == sorted(values, reverse=True)


def test_a_backlog_with_a_near_deadline_asks_for_more_workers_now() -> None:
    scaler = DesiredWorkers(0.7, window_s=10.0, cooldown_s=0.0)
    scaler.observe(0.0, 0, 0, 100.0, 60.0)
    assert scaler.observe(1.0, 0, 500, 100.0, 60.0) == 1  # 500 jobs in a minute: one worker
    assert scaler.observe(2.0, 0, 500, 100.0, 1.0) == 5  # in a second: five
    assert scaler.needed == pytest.approx(5.0)


def test_the_target_is_a_utilisation_under_one() -> None:
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            DesiredWorkers(bad, 10.0, 10.0)
