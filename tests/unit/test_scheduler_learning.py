"""What the scheduler learns: the latency and memory fits, and the memory ceiling after an OOM.

A fit is the least-squares line of its prior's two points and the observations,
each older observation weighted down by the forget factor; the tests compare
it with the standard library's regression over points repeated by weight.
"""

from __future__ import annotations

import math
import statistics

import pytest

from scheduler.learning import (
    CEILING_RELAX_AFTER,
    BatchObservation,
    OnlineFit,
    SchedulerState,
    Tuning,
)
from scheduler.policy import LinearFit


def regression(points: list[tuple[float, float, int]]) -> LinearFit:
    """Least squares over (x, y, copies): a weight of n is the point n times."""
    xs = [x for x, _, n in points for _ in range(n)]
    ys = [y for _, y, n in points for _ in range(n)]
    line = statistics.linear_regression(xs, ys)
    return LinearFit(line.intercept, line.slope)


def assert_same_line(fit: LinearFit, expected: LinearFit) -> None:
    assert fit.intercept == pytest.approx(expected.intercept, rel=1e-9)
    assert fit.slope == pytest.approx(expected.slope, rel=1e-9)


# Latencies around a line, not on it, with a positive intercept and slope.
SEEN = [(200.0, 0.0095), (50.0, 0.0052), (400.0, 0.0121)]


def test_a_fit_weighs_its_prior_and_its_observations_by_age() -> None:
    prior = LinearFit(0.004, 2e-5)
    fit = OnlineFit(prior, forget=0.5, prior_span=100.0)
    for x, y in SEEN:
        fit.observe(x, y)
    # After three observations at forget 0.5: the prior's two points (at 0 and at the
    # span) weigh 1/8 each, the observations 1/4, 1/2 and 1 (copies: 1, 1, 2, 4, 8).
    expected = regression(
        [(0.0, prior(0.0), 1), (100.0, prior(100.0), 1)]
        + [(x, y, n) for (x, y), n in zip(SEEN, (2, 4, 8), strict=True)]
    )
    assert_same_line(fit.fit(), expected)
    assert fit.observations == 3


def test_the_state_learns_at_the_tunings_pace_from_its_priors() -> None:
    tuning = Tuning(learning_forget=0.5)
    latency_prior, memory_prior = LinearFit(0.004, 2e-5), LinearFit(1000.0, 3.0)
    state = SchedulerState.create(tuning, latency_prior, memory_prior, prior_span=100.0)
    peaks = [(200.0, 1500.0), (50.0, 1100.0), (400.0, 2400.0)]
    for (work, latency_s), (_, peak) in zip(SEEN, peaks, strict=True):
        state.observe_batch(
            BatchObservation(
                size=1, cost=int(work), work=work, latency_s=latency_s, ended_s=0.0,
                peak_memory_bytes=peak,
            )
        )  # fmt: skip
    for fit, prior, seen in (
        (state.latency, latency_prior, SEEN),
        (state.memory, memory_prior, peaks),
    ):
        expected = regression(
            [(0.0, prior(0.0), 1), (100.0, prior(100.0), 1)]
            + [(x, y, n) for (x, y), n in zip(seen, (2, 4, 8), strict=True)]
        )
        assert_same_line(fit.fit(), expected)


def test_without_a_prior_nothing_is_known_and_nothing_is_predicted() -> None:
    fit = OnlineFit()
    assert not fit.known and fit.observations == 0
    assert fit.fit() == LinearFit()


def test_one_observation_is_a_flat_line_through_it() -> None:
    fit = OnlineFit(forget=1.0)
    fit.observe(10.0, 5.0)
    assert fit.fit() == LinearFit(5.0, 0.0)


@pytest.mark.parametrize(
    ("points", "slope"),
    [
        # Least squares gives 0.2 x - 1; through the origin: sum xy / sum xx = 70 / 500.
        ([(10.0, 1.0), (20.0, 3.0)], 0.14),
        ([(0.1, 0.1), (0.2, 0.3)], 1.4),
    ],
)
def test_a_negative_fixed_cost_becomes_a_line_through_the_origin(
    points: list[tuple[float, float]], slope: float
) -> None:
    fit = OnlineFit(forget=1.0)
    for x, y in points:
        fit.observe(x, y)
    line = fit.fit()
    assert line.intercept == 0.0
    assert line.slope == pytest.approx(slope)


@pytest.mark.parametrize(("x", "y"), [(10.0, math.nan), (math.inf, 1.0), (10.0, -math.inf)])
def test_a_non_finite_observation_is_ignored(x: float, y: float) -> None:
    fit = OnlineFit(forget=1.0)
    fit.observe(x, y)
    assert not fit.known and fit.observations == 0
    fit.observe(10.0, 2.0)
    fit.observe(x, y)
    assert fit.observations == 1
    assert fit.fit() == LinearFit(2.0, 0.0)


def test_by_default_a_fit_follows_the_model_when_it_changes_speed() -> None:
    fit = OnlineFit()
    for _ in range(200):
        for x in (10.0, 100.0):
            fit.observe(x, 0.010 + 1e-4 * x)  # the old speed
    for _ in range(200):
        for x in (10.0, 100.0):
            fit.observe(x, 0.002 + 2e-5 * x)  # the new one
    line = fit.fit()
    assert line.intercept == pytest.approx(0.002, rel=1e-3)
    assert line.slope == pytest.approx(2e-5, rel=1e-3)


# --- out of memory ----------------------------------------------------------------------


def test_each_out_of_memory_is_counted() -> None:
    state = SchedulerState.create(Tuning(), memory_prior=LinearFit(0.0, 1.0))
    for work in (800.0, 400.0, 200.0):
        state.observe_oom(work)
    assert state.ooms == 3


def test_without_a_memory_model_an_oom_caps_the_work_itself() -> None:
    state = SchedulerState.create(Tuning(oom_backoff=0.9))
    assert not state.memory.known and state.profile(0.0).max_work == math.inf
    state.observe_oom(500.0)
    # The work stands in for the memory: at most 90 % of the failed work from now on.
    assert state.memory_ceiling == pytest.approx(450.0)
    assert state.profile(0.0).max_work == pytest.approx(450.0)


def test_a_model_declaring_no_memory_use_is_capped_by_work_after_an_oom() -> None:
    state = SchedulerState.create(Tuning(oom_backoff=0.9), memory_prior=LinearFit(0.0, 0.0))
    state.observe_oom(500.0)
    assert state.profile(0.0).max_work == pytest.approx(450.0)


def test_after_an_oom_measured_peaks_take_over_at_the_tunings_pace() -> None:
    state = SchedulerState.create(Tuning(learning_forget=0.5, oom_backoff=0.9))
    state.observe_oom(500.0)
    peaks = [(100.0, 1500.0), (200.0, 1900.0), (400.0, 3100.0)]
    for work, peak in peaks:
        state.observe_batch(
            BatchObservation(
                size=1, cost=int(work), work=work, latency_s=0.01, ended_s=0.0,
                peak_memory_bytes=peak,
            )
        )  # fmt: skip
    # The stand-in (memory = work, as two points at 0 and 1) fades like a prior.
    expected = regression(
        [(0.0, 0.0, 1), (1.0, 1.0, 1)]
        + [(x, y, n) for (x, y), n in zip(peaks, (2, 4, 8), strict=True)]
    )
    assert_same_line(state.memory.fit(), expected)


def test_a_lowered_ceiling_rises_two_percent_per_hundred_clean_batches() -> None:
    state = SchedulerState.create(
        Tuning(memory_budget_bytes=1000.0, memory_threshold=0.8, oom_backoff=0.9),
        memory_prior=LinearFit(0.0, 1.0),
    )
    state.observe_oom(500.0)
    clean = BatchObservation(size=1, cost=10, work=10, latency_s=0.01, ended_s=0.0)
    ceilings = {}
    for n in range(1, 2 * CEILING_RELAX_AFTER + 1):
        state.observe_batch(clean)
        ceilings[n] = state.memory_ceiling
    assert ceilings[CEILING_RELAX_AFTER - 1] == pytest.approx(450.0)
    assert ceilings[CEILING_RELAX_AFTER] == pytest.approx(450.0 * 1.02)
    assert ceilings[2 * CEILING_RELAX_AFTER - 1] == pytest.approx(450.0 * 1.02)
    assert ceilings[2 * CEILING_RELAX_AFTER] == pytest.approx(450.0 * 1.02**2)


def test_a_prior_counts_as_two_observations_at_zero_and_one_unless_told() -> None:
    prior = LinearFit(0.004, 2e-5)
    state = SchedulerState.create(Tuning(learning_forget=0.5), latency_prior=prior)
    for x, y in SEEN:
        state.observe_batch(BatchObservation(size=1, cost=int(x), work=x, latency_s=y, ended_s=0.0))
    expected = regression(
        [(0.0, prior(0.0), 1), (1.0, prior(1.0), 1)]
        + [(x, y, n) for (x, y), n in zip(SEEN, (2, 4, 8), strict=True)]
    )
    assert_same_line(state.latency.fit(), expected)
