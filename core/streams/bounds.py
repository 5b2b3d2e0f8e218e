"""How much a model's queue may hold, and how long a refused client should wait.

Each model's queue is bounded in jobs (``FERRY_QUEUE_MAX_JOBS``) and in the
bytes of their inputs (``FERRY_QUEUE_MAX_BYTES``). A submission that would
take the queue past either is refused with a 503 whose ``Retry-After`` is the
time the model's workers are predicted to take to finish enough of the jobs
ahead for it to fit: the same learned estimates that quote ``estimated_wait_ms``
and refuse a deadline (``core.models.estimates``, ``core.models.generation_estimates``).
Pure: the caller brings the counts and the estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Before any worker of the model has published what it learned, no drain rate is
# known: the refused are asked to come back after this.
UNKNOWN_RATE_RETRY_AFTER_S = 5
# A client told to come back later than this would rather be told to look again.
MAX_RETRY_AFTER_S = 3600
# Urgent and vip jobs may fill this share more than the bounds: a queue that normal and
# bulk work keep full still takes them (the lanes then run them first).
PRIORITY_HEADROOM = 0.1
PRIORITY_LANES = frozenset({"urgent", "vip"})


@dataclass(frozen=True)
class Excess:
    """Why a submission does not fit: the bound it would pass (its setting's name), the
    bound's value, what the queue holds of it, and the jobs ahead that must finish first."""

    setting: str
    limit: int
    queued: int
    jobs_to_finish: int


@dataclass(frozen=True)
class QueueBound:
    """Per model: at most ``max_jobs`` jobs and ``max_bytes`` bytes of input (0: no bound)."""

    max_jobs: int = 0
    max_bytes: int = 0

    @property
    def bounded(self) -> bool:
        return self.max_jobs > 0 or self.max_bytes > 0

    def for_lane(self, lane: str) -> QueueBound:
        """The bounds a job of ``lane`` is held to (urgent and vip: PRIORITY_HEADROOM more)."""
        if lane not in PRIORITY_LANES or not self.bounded:
            return self
        return QueueBound(_with_headroom(self.max_jobs), _with_headroom(self.max_bytes))

    def never_fits(self, input_bytes: int) -> bool:
        """An input larger than the whole byte bound would wait for ever: refused at once."""
        return self.max_bytes > 0 and input_bytes > self.max_bytes

    def excess(self, jobs: int, queued_bytes: int, input_bytes: int) -> Excess | None:
        """What stands in the way of one more job of ``input_bytes`` in a queue of ``jobs``
        jobs holding ``queued_bytes``; None when it fits."""
        if self.max_jobs > 0 and jobs + 1 > self.max_jobs:
            return Excess("FERRY_QUEUE_MAX_JOBS", self.max_jobs, jobs, jobs + 1 - self.max_jobs)
        # An empty queue holds no bytes, whatever its counter says (core.streams.protocol).
        if self.max_bytes > 0 and jobs > 0 and queued_bytes + input_bytes > self.max_bytes:
            over = queued_bytes + input_bytes - self.max_bytes
            # The queued jobs leave with their bytes, about the mean each.
            mean = queued_bytes / jobs
            to_finish = min(jobs, math.ceil(over / max(mean, 1.0)))
            return Excess("FERRY_QUEUE_MAX_BYTES", self.max_bytes, queued_bytes, to_finish)
        return None


def retry_after_s(drain_s: float | None) -> int:
    """``Retry-After`` for a refusal, from the predicted seconds until enough of the queue
    has run (None: nothing learned yet); whole seconds, at least one."""
    if drain_s is None or not math.isfinite(drain_s):
        return UNKNOWN_RATE_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(drain_s)))


def _with_headroom(limit: int) -> int:
    return limit + max(1, math.ceil(limit * PRIORITY_HEADROOM)) if limit > 0 else 0
