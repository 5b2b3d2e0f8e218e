"""The words every part of Ferry shares: lanes, the triggers of a batch, a batch's work.

Defined once, here, at the bottom of the dependency order (this module
imports nothing of Ferry's), so the API, the workers, the scheduler and the
benchmarks all use the same values. Both enumerations are string enums: a
member compares equal to its value and is written as it (JSON, Redis, logs).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

# The bounds of a model's batch size when FERRY_BATCH_MAX_SIZE is unset
# (scheduler.learning.derived_batch_size). The floor is the count Ferry used to
# ship and fixed batching's default. The ceiling bounds what a worker holds (at
# least one full batch) and so the CPU time of a decision, which grows with
# what is pending: about 0.6 ms over 256 jobs in CPython, inside a small
# model's batch on a GPU, where the worker decides the next batch while one
# computes.
BATCH_SIZE_FLOOR = 32
BATCH_SIZE_CEILING = 256


class Lane(StrEnum):
    """A job's priority; a worker serves the lanes in this order."""

    URGENT = "urgent"
    VIP = "vip"
    NORMAL = "normal"
    BULK = "bulk"  # backfills: the capacity live traffic leaves

    @property
    def rank(self) -> int:
        """0 for the most urgent lane."""
        return RANK[self]


LANES: tuple[Lane, ...] = tuple(Lane)
# A lane's rank by its name (a plain string or a Lane: they hash alike).
RANK: dict[str, int] = {lane: rank for rank, lane in enumerate(LANES)}


class Trigger(StrEnum):
    """Why a batch was dispatched now."""

    URGENT = "urgent"  # it holds an urgent job
    SIZE = "size"  # it is full (the item limit)
    COST = "cost"  # a work limit: the cost cap, or the load's target cost is pending
    MEMORY = "memory"  # it would be predicted to peak above the memory ceiling with more
    LATENCY = "latency"  # more would make it slower than the urgent guard or the riders allow
    DEADLINE = "deadline"  # waiting longer would miss the earliest deadline in it
    TIME = "time"  # its oldest job waited out the window
    IDLE = "idle"  # the model was idle and the queue short: it runs at once
    SINGLE = "single"  # no batching: one job at a time (the ``none`` scheduler)

    @property
    def ahead(self) -> bool:
        """The batch would not grow by waiting (full, or must not wait).

        Such a batch may be prepared while the one before computes; an
        underfull batch that merely waited long enough (``time``, ``idle``)
        is decided again once the device is free, with what arrived meanwhile.
        """
        return self not in (Trigger.TIME, Trigger.IDLE, Trigger.SINGLE)


def work_of(count: int, total_cost: float, max_cost: float, padded: bool) -> float:
    """What the model computes for a batch: for a padded model every input is
    padded to the longest, so ``count x max cost``; otherwise the sum of the costs."""
    return count * max_cost if padded else total_cost


def batch_work(costs: Sequence[int], padded: bool) -> float:
    """:func:`work_of` for the costs of a batch's items (0 for none)."""
    if not costs:
        return 0.0
    return float(work_of(len(costs), sum(costs), max(costs), padded))


class PolicyKind(StrEnum):
    """Which batching a worker applies (the ``scheduler`` setting)."""

    FERRY = "ferry"  # Ferry's policy (scheduler.policy.decide)
    FIXED = "fixed"  # first come first served, a maximum size and delay (Triton, Ray Serve)
    NONE = "none"  # one job at a time


class FinishReason(StrEnum):
    """Why a generated sequence ended (the generation scheduler and its runtime)."""

    STOP = "stop"  # a stop token or stop string was sampled
    LENGTH = "length"  # it generated its max_tokens
    CANCELLED = "cancelled"  # the client asked
    EXPIRED = "expired"  # its deadline could not be met before its first step
