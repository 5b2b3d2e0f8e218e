"""The two quantiles the benchmarks report, and the spread of repeated runs, each written once.

* :func:`quantile`: linear between the nearest ranks (numpy's default), for
  figures computed from a sample in memory;
* :func:`nearest_rank`: the value at rank ``floor(q x n)`` of a sorted
  sample, what the end-to-end benchmarks have always published (their files
  stay comparable across runs);
* :func:`median_range`: a figure over repeated runs, its median and range, as
  the results files hold it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile, linear between the nearest ranks (NaN of nothing)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The value at rank ``floor(q x n)`` of ``ordered`` (sorted), NaN of nothing."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_range(values: Sequence[float]) -> dict[str, float]:
    """The median of ``values`` and their range, to three places (NaN each of nothing)."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }
