"""bench/quantiles.py: the nearest-rank quantile the end-to-end benchmarks publish."""

from __future__ import annotations

import math

import pytest

from bench.quantiles import nearest_rank, quantile


@pytest.mark.parametrize(
    ("q", "expected"), [(0.0, 1.0), (0.5, 6.0), (0.9, 10.0), (0.99, 10.0), (1.0, 10.0)]
)
def test_the_nearest_rank_is_the_value_at_floor_q_n(q: float, expected: float) -> None:
    ordered = [float(v) for v in range(1, 11)]
    assert nearest_rank(ordered, q) == expected


def test_the_nearest_rank_of_nothing_is_nan_and_it_differs_from_the_linear_one() -> None:
    assert math.isnan(nearest_rank([], 0.5))
    assert nearest_rank([1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0], 0.5) == 1.5
