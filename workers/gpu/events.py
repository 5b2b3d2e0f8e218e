"""What a worker's batches go through, told to whoever watches: metrics, logs, Flower, webhooks.

The batch loop announces each step of a batch once, to an :class:`Observers`
fan-out; what watches (``workers.gpu.observe`` for Prometheus,
:class:`BatchLog` for the log, ``workers.gpu.presence`` for Flower,
:class:`KickDeliveries` for webhooks) is an observer, not a call inside the
loop. An observer that raises is logged and skipped: it cannot break the
batch or the observers after it. Hooks run on the loop's thread or, for a
pipelined worker, on its recording thread; they must not block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.streams.protocol import JobMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchStarted:
    """A batch claimed and about to be prepared for the device."""

    batch_id: str
    model: str
    jobs: Sequence[JobMessage]  # the claimed jobs, in the batch's order
    costs: Sequence[int]
    predicted_s: float  # the scheduler's prediction of its latency
    at_s: float  # the loop's clock


@dataclass(frozen=True)
class BatchFinished:
    """A batch whose outcomes are recorded and acknowledged."""

    batch_id: str
    model: str
    jobs: Sequence[JobMessage]  # the claimed jobs
    lanes: Sequence[str]  # the lanes of every entry it was decided for
    costs: Sequence[int]
    trigger: str | None
    predicted_s: float
    batch_s: float  # its latency as the scheduler plans it
    efficiency: float
    window_s: float | None  # the scheduler's window after it
    peak_memory_bytes: float | None
    failed: int  # jobs of the batch that failed
    runtime_s: float  # claimed -> recorded


@dataclass(frozen=True)
class JobDone:
    """A job whose outcome was written and whose entry is acknowledged."""

    job: JobMessage
    status: str


class BatchObserver:
    """Hooks on a worker's batches; each does nothing unless overridden."""

    def batch_started(self, batch: BatchStarted) -> None:
        """Claimed: its jobs leave the queue for the device."""

    def batch_computed(self, device_s: float) -> None:
        """The device was busy ``device_s`` for a batch."""

    def stage_timed(self, stage: str, seconds: float, batch_id: str | None) -> None:
        """A batch spent ``seconds`` (just now) preparing, recording or acknowledging
        (``batch_id`` None: outcomes settled without a batch)."""

    def batch_finished(self, batch: BatchFinished) -> None:
        """Recorded and acknowledged."""

    def batch_failed(self, batch_id: str, runtime_s: float, size: int, error: str) -> None:
        """Broke off before it was recorded: its jobs stay pending and run again."""

    def jobs_finished(self, done: Sequence[JobDone], batch_id: str | None, at_s: float) -> None:
        """Outcomes written and entries acknowledged (a batch's, or jobs settled without one)."""

    def jobs_dead_lettered(self, jobs: Sequence[JobMessage]) -> None:
        """Out of attempts: moved to the dead-letter stream."""

    def entries_reclaimed(self, count: int) -> None:
        """Entries taken over from a worker that stopped answering."""

    def deliveries_created(self, delivery_ids: Sequence[str]) -> None:
        """Webhook deliveries committed with the outcomes just acknowledged."""


class Observers(BatchObserver):
    """Tells every observer, in order; one that raises is logged and the others still hear."""

    def __init__(self, *observers: BatchObserver) -> None:
        self.observers = list(observers)

    def add(self, observer: BatchObserver) -> None:
        self.observers.append(observer)

    def _each(self, hook: str, call: Callable[[BatchObserver], None]) -> None:
        for observer in self.observers:
            try:
                call(observer)
            except Exception:
                log.exception(
                    "a batch observer failed",
                    extra={"observer": type(observer).__name__, "hook": hook},
                )

    def batch_started(self, batch: BatchStarted) -> None:
        self._each("batch_started", lambda o: o.batch_started(batch))

    def batch_computed(self, device_s: float) -> None:
        self._each("batch_computed", lambda o: o.batch_computed(device_s))

    def stage_timed(self, stage: str, seconds: float, batch_id: str | None) -> None:
        self._each("stage_timed", lambda o: o.stage_timed(stage, seconds, batch_id))

    def batch_finished(self, batch: BatchFinished) -> None:
        self._each("batch_finished", lambda o: o.batch_finished(batch))

    def batch_failed(self, batch_id: str, runtime_s: float, size: int, error: str) -> None:
        self._each("batch_failed", lambda o: o.batch_failed(batch_id, runtime_s, size, error))

    def jobs_finished(self, done: Sequence[JobDone], batch_id: str | None, at_s: float) -> None:
        self._each("jobs_finished", lambda o: o.jobs_finished(done, batch_id, at_s))

    def jobs_dead_lettered(self, jobs: Sequence[JobMessage]) -> None:
        self._each("jobs_dead_lettered", lambda o: o.jobs_dead_lettered(jobs))

    def entries_reclaimed(self, count: int) -> None:
        self._each("entries_reclaimed", lambda o: o.entries_reclaimed(count))

    def deliveries_created(self, delivery_ids: Sequence[str]) -> None:
        self._each("deliveries_created", lambda o: o.deliveries_created(delivery_ids))


class BatchLog(BatchObserver):
    """One log line per batch, and one per job that came with a request id."""

    def __init__(self, model: str) -> None:
        self.model = model

    def batch_finished(self, batch: BatchFinished) -> None:
        log.info(
            "batch done",
            extra={
                "model": batch.model,
                "batch_id": batch.batch_id,
                "size": len(batch.jobs),
                "cost": sum(batch.costs),
                "efficiency": round(batch.efficiency, 3),
                "lanes": sorted(set(batch.lanes)),
                "batch_ms": round(batch.batch_s * 1000.0, 2),
                "predicted_ms": round(batch.predicted_s * 1000.0, 2),
                "trigger": batch.trigger,
                "failed": batch.failed,
            },
        )

    def jobs_finished(self, done: Sequence[JobDone], batch_id: str | None, at_s: float) -> None:
        for finished in done:
            job = finished.job
            # A request's X-Request-ID follows its job here (backfill items have
            # none: their batches are logged whole).
            if job.request_id:
                log.info(
                    "job finished",
                    extra={
                        "job_id": job.job_id,
                        "request_id": job.request_id,
                        "batch_id": batch_id,
                        "model": self.model,
                        "lane": job.lane,
                        "status": finished.status,
                    },
                )


class KickDeliveries(BatchObserver):
    """Hands new webhook deliveries to Celery once their jobs are acknowledged."""

    def __init__(self, kick: Callable[[list[str]], None]) -> None:
        self.kick = kick

    def deliveries_created(self, delivery_ids: Sequence[str]) -> None:
        self.kick(list(delivery_ids))
