"""The two quantiles the benchmarks report, each written once.

* :func:`quantile`: linear between the nearest ranks (numpy's default), for
  figures computed from a sample in memory;
* :func:`nearest_rank`: the value at rank ``floor(q x n)`` of a sorted
  sample, what the end-to-end benchmarks have always published (their files
  stay comparable across runs).
"""

from __future__ import annotations

import math
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
