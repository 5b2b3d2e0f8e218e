"""What a worker has learned, published for the API, and its heartbeat.

After its batches a worker publishes its model's fitted latency, usual batch
and window (:class:`~core.models.estimates.ModelEstimate`, plus running averages)
into the model's stats hash, which ``/v1/models`` and the API's wait
estimates read; and it beats in the model's workers set, so the API knows
how many workers share the queue. With them go what the API's circuit
breaker reads (api/breaker.py): the p99 latency of the jobs finished in the
last :data:`LATENCY_WINDOW_S`, by lane, the latency target, and the share of
the memory budget the last batch peaked at.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis
from redis.exceptions import OutOfMemoryError

from core.streams.protocol import stats_key, workers_key
from core.streams.queues import HEARTBEAT_TTL_S
from core.streams.target import REDIS_ERRORS
from scheduler.learning import BatchObservation, SchedulerState
from scheduler.vocabulary import LANES
from workers.gpu.scheduling import estimate_of

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
# What the worker learned is published at most this often: the API reads it at
# most every 250 ms (api.jobs.submissions.VIEW_TTL_S), so a write per batch is waste.
PUBLISH_S = 0.25
# The jobs whose latency the published p99 is of: those finished in the last this many seconds.
LATENCY_WINDOW_S = 10.0


class RecentLatencies:
    """The latencies of the jobs finished in the last ``window_s``, by lane."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, str, float]] = deque()

    def add(self, now: float, lanes: Sequence[str], latencies_s: Sequence[float]) -> None:
        self._seen.extend((now, lane, s) for lane, s in zip(lanes, latencies_s, strict=True))

    def expire(self, now: float) -> bool:
        """Forget what left the window; whether anything did."""
        expired = False
        while self._seen and now - self._seen[0][0] > self.window_s:
            self._seen.popleft()
            expired = True
        return expired

    def p99_ms(self, lanes: tuple[str, ...]) -> dict[str, float]:
        """Each lane's p99 in milliseconds (0 for a lane with no job in the window)."""
        by_lane: dict[str, list[float]] = {lane: [] for lane in lanes}
        for _at, lane, seconds in self._seen:
            by_lane.setdefault(lane, []).append(seconds)
        found = {}
        for lane, values in by_lane.items():
            values.sort()
            rank = max(0, math.ceil(0.99 * len(values)) - 1)
            found[lane] = round(values[rank] * 1000.0, 1) if values else 0.0
        return found


@dataclass
class LoopStats:
    """Running averages of recent batches (what /v1/models and the API's estimates show)."""

    batches: int = 0
    jobs: int = 0
    avg_batch_ms: float = 0.0
    avg_batch_size: float = 0.0
    mean_cost: float = 0.0  # per item
    pad_ratio: float = 1.0  # work / sum of costs
    efficiency: float = 1.0

    def add(self, size: int, cost: int, work: float, batch_ms: float, eff: float) -> None:
        self.batches += 1
        self.jobs += size
        alpha = 1.0 if self.batches == 1 else 0.2
        self.avg_batch_ms += alpha * (batch_ms - self.avg_batch_ms)
        self.avg_batch_size += alpha * (size - self.avg_batch_size)
        self.mean_cost += alpha * (cost / size - self.mean_cost)
        self.pad_ratio += alpha * (work / max(cost, 1) - self.pad_ratio)
        self.efficiency += alpha * (eff - self.efficiency)


@dataclass(eq=False)
class Publisher:
    """Publishes what ``state`` has learned (at most every PUBLISH_S) and the heartbeat."""

    client: redis.Redis
    prefix: str
    model: str
    consumer: str
    clock: Callable[[], float] = time.time  # the wall clock of the heartbeat's score
    stats: LoopStats = field(init=False, default_factory=LoopStats)
    recent: RecentLatencies = field(init=False, repr=False, default_factory=RecentLatencies)
    memory_fraction: float | None = field(init=False, default=None)
    _published_at: float = field(init=False, repr=False, default=0.0)
    _unpublished: bool = field(init=False, repr=False, default=False)
    _last_beat: float = field(init=False, repr=False, default=0.0)

    def learned(self, state: SchedulerState, seen: BatchObservation, eff: float) -> None:
        """A batch was learned from (``state`` already holds it)."""
        self.stats.add(seen.size, seen.cost, seen.work, seen.latency_s * 1000.0, eff)
        self.recent.add(time.monotonic(), seen.lanes, seen.job_latency_s)
        budget = state.tuning.memory_budget_bytes
        if seen.peak_memory_bytes is not None and budget:
            self.memory_fraction = seen.peak_memory_bytes / budget
        if time.monotonic() - self._published_at < PUBLISH_S:
            self._unpublished = True  # the heartbeat publishes it once PUBLISH_S has passed
            return
        try:
            self.publish(state)
        except REDIS_ERRORS as exc:
            # Advisory (estimates for the API): the batch is recorded all the same,
            # and the next batch publishes again.
            log.warning(
                "learned figures not published",
                extra={"model": self.model, "error_type": type(exc).__name__},
            )

    def publish(self, state: SchedulerState) -> None:
        """What this worker has learned, for /v1/models and the API's wait estimates."""
        stats = self.stats
        estimate = estimate_of(
            state, stats.mean_cost, stats.pad_ratio if state.tuning.padded else 1.0
        )
        mapping = estimate.to_hash()
        self.recent.expire(time.monotonic())
        mapping |= {f"p99_ms_{lane}": f"{ms:.1f}" for lane, ms in self.recent.p99_ms(LANES).items()}
        # The breaker's latency signal is for a model given a target (its SLA); without one,
        # a backlog is what a queue is for ("0" also clears one published before).
        target_ms = state.tuning.latency_target_ms
        mapping["latency_target_ms"] = f"{target_ms:.1f}" if target_ms is not None else "0"
        if self.memory_fraction is not None:
            mapping["memory_fraction"] = f"{self.memory_fraction:.4f}"
        if stats.batches:
            mapping |= {
                "avg_batch_ms": f"{stats.avg_batch_ms:.3f}",
                "avg_batch_size": f"{stats.avg_batch_size:.3f}",
                "efficiency": f"{stats.efficiency:.4f}",
            }
        self.client.hset(stats_key(self.prefix, self.model), mapping=mapping)  # type: ignore[arg-type]
        self._published_at = time.monotonic()
        self._unpublished = False

    def beat(self, state: SchedulerState) -> None:
        """Publish what a burst's last batches taught, and say this worker is alive."""
        now = time.monotonic()
        if self.recent.expire(now):
            self._unpublished = True  # the p99 of an emptier window: the breaker may close
        if self._unpublished and now - self._published_at >= PUBLISH_S:
            with contextlib.suppress(*REDIS_ERRORS):
                self.publish(state)
        self.heartbeat(now)

    def heartbeat(self, now: float | None = None) -> None:
        """Say this worker is alive (at most every HEARTBEAT_S)."""
        now = time.monotonic() if now is None else now
        if now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        key = workers_key(self.prefix, self.model)
        wall = self.clock()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(key, {self.consumer: wall})
        # Workers that died without saying so: forget them after a while.
        pipe.zremrangebyscore(key, "-inf", wall - 30 * HEARTBEAT_TTL_S)
        try:
            pipe.execute()
        except OutOfMemoryError:
            # Redis at its maxmemory refuses the ZADD, but reads and acknowledgements go
            # on, and they are what frees memory: the worker keeps working, unseen by the
            # API's count of live workers until its next beat lands.
            log.warning("heartbeat refused: Redis is at its maxmemory", extra={"model": self.model})

    def leave(self) -> None:
        """This worker stops: the API no longer counts it."""
        with contextlib.suppress(*REDIS_ERRORS):
            self.client.zrem(workers_key(self.prefix, self.model), self.consumer)
