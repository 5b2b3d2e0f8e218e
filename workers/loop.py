"""The batch loop of one GPU worker: read, decide, run, record, acknowledge.

The loop applies the scheduler's decisions; it never decides itself. An entry
is acknowledged only after its job's outcome is committed (or after it was
found to need no run: cancelled, missing, already finished).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis
from sqlalchemy.exc import SQLAlchemyError

from core.streams import done_channel, stats_key, worker_key
from scheduler import BatchDecision, PendingItem, Profile, decide
from workers.consumer import Entry, StreamConsumer
from workers.execute import run_isolating
from workers.recorder import Outcome, Recorder
from workers.runtimes.base import Runtime

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
HEARTBEAT_TTL_S = 10
MAX_BLOCK_MS = 1000
RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0


@dataclass
class LoopStats:
    batches: int = 0
    jobs: int = 0
    avg_batch_ms: float = 0.0


class BatchLoop:
    def __init__(
        self,
        *,
        runtime: Runtime,
        consumer: StreamConsumer,
        recorder: Recorder,
        client: redis.Redis,
        prefix: str,
        profile: Profile,
        prefetch: int,
        max_attempts: int = 3,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.runtime = runtime
        self.consumer = consumer
        self.recorder = recorder
        self.client = client
        self.prefix = prefix
        self.profile = profile
        self.prefetch = prefetch
        self.max_attempts = max_attempts
        self.clock = clock
        self.pending: dict[str, Entry] = {}
        self.stats = LoopStats()
        self._last_beat = 0.0

    @property
    def model(self) -> str:
        return self.consumer.model

    def run(self, stop: threading.Event) -> None:
        self._retrying(stop, self.consumer.ensure_groups)
        log.info("worker ready", extra={"model": self.model, "consumer": self.consumer.consumer})
        wait_ms: int | None = MAX_BLOCK_MS
        backoff_s = RETRY_MIN_S
        while not stop.is_set():
            try:
                wait_ms = self.step(wait_ms)
                backoff_s = RETRY_MIN_S
            except (redis.RedisError, SQLAlchemyError) as exc:
                # Whatever was read but not recorded is still pending in Redis:
                # forget the local copy and read it again once things are back.
                log.warning(
                    "dependency error; retrying",
                    extra={"model": self.model, "error_type": type(exc).__name__,
                           "retry_in_s": backoff_s},
                )  # fmt: skip
                self.pending.clear()
                self.consumer.reread_pending()
                stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, RETRY_MAX_S)
                wait_ms = MAX_BLOCK_MS
        # Entries read but not run stay unacknowledged; this consumer name gets
        # them back at its next start.
        with contextlib.suppress(redis.RedisError):
            self.client.delete(worker_key(self.prefix, self.model, self.consumer.consumer))
        log.info("worker stopped", extra={"model": self.model, "left_pending": len(self.pending)})

    def step(self, wait_ms: int | None) -> int | None:
        """One turn: read, decide, apply. Returns how long the next read may block."""
        self._heartbeat()
        self._fill(wait_ms)
        decision = decide(self._items(), self.profile, self.clock())
        self.apply(decision)
        if decision.run:
            return None  # more may be ready: look again without blocking
        if decision.wait_s is not None:
            return min(MAX_BLOCK_MS, int(decision.wait_s * 1000)) or None
        return MAX_BLOCK_MS

    def _retrying(self, stop: threading.Event, action: Callable[[], None]) -> None:
        backoff_s = RETRY_MIN_S
        while not stop.is_set():
            try:
                action()
                return
            except redis.RedisError as exc:
                log.warning("redis unavailable at start; retrying",
                            extra={"error_type": type(exc).__name__})  # fmt: skip
                stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, RETRY_MAX_S)

    def _fill(self, block_ms: int | None) -> None:
        room = self.prefetch - len(self.pending)
        if room <= 0:
            return
        for entry in self.consumer.read(room, block_ms):
            self.pending.setdefault(entry.entry_id + "@" + entry.stream, entry)

    def _items(self) -> list[PendingItem]:
        return [
            PendingItem(
                key=key,
                lane=e.message.lane,
                cost=e.message.cost,
                arrival_s=e.message.enqueued_at_ms / 1000.0,
                deadline_s=(e.message.deadline_at_ms / 1000.0)
                if e.message.deadline_at_ms is not None
                else None,
            )
            for key, e in self.pending.items()
        ]

    def apply(self, decision: BatchDecision) -> None:
        if decision.expire:
            self._expire([self.pending.pop(item.key) for item in decision.expire])
        if decision.run:
            self._run_batch([self.pending.pop(item.key) for item in decision.run])

    def _expire(self, entries: list[Entry]) -> None:
        written = self._settle_unrunnable([e.message.job_id for e in entries], [])
        self._acknowledge(entries, written)
        log.info("jobs expired", extra={"model": self.model, "count": len(written)})

    def _run_batch(self, entries: list[Entry]) -> None:
        batch_id = str(uuid.uuid4())
        by_job = {e.message.job_id: e for e in entries}
        claimed, late, exhausted = self.recorder.claim(
            list(by_job), _utc(self.clock()), self.max_attempts
        )
        written = self._settle_unrunnable(late, [by_job[job_id] for job_id in exhausted])
        started = time.perf_counter()
        results = run_isolating(self.runtime.run, [c.input for c in claimed])
        batch_ms = (time.perf_counter() - started) * 1000.0
        outcomes = [
            Outcome(
                job.job_id,
                "succeeded" if result.ok else "failed",
                output=result.output,
                error=result.error,
                inference_ms=result.inference_ms,
            )
            for job, result in zip(claimed, results, strict=True)
        ]
        written += self.recorder.finish(
            outcomes, _utc(self.clock()), batch_id=batch_id, batch_size=len(claimed) or None
        )
        self._acknowledge(entries, written)
        if claimed:
            self._learn(len(claimed), batch_ms)
        log.info(
            "batch done",
            extra={
                "model": self.model,
                "batch_id": batch_id,
                "size": len(claimed),
                "cost": sum(e.message.cost for e in entries),
                "lanes": sorted({e.message.lane for e in entries}),
                "batch_ms": round(batch_ms, 2),
                "failed": sum(1 for r in results if not r.ok),
            },
        )

    def _settle_unrunnable(self, late: list[str], exhausted: list[Entry]) -> list[str]:
        """Record the jobs a batch will not run: past their deadline, or out of attempts."""
        outcomes = [
            Outcome(job_id, "expired", error="deadline passed before the job started")
            for job_id in late
        ]
        if exhausted:
            self.consumer.dead_letter(exhausted)
            outcomes += [
                Outcome(
                    e.message.job_id,
                    "failed",
                    error=f"gave up after {self.max_attempts} attempts "
                    "(the worker stopped while running it each time)",
                )
                for e in exhausted
            ]
        return self.recorder.finish(outcomes, _utc(self.clock()), batch_id=None, batch_size=None)

    def _acknowledge(self, entries: list[Entry], written: list[str]) -> None:
        self.consumer.ack(entries)
        if written:
            self.client.publish(done_channel(self.prefix), ",".join(written))

    def _learn(self, size: int, batch_ms: float) -> None:
        stats = self.stats
        stats.batches += 1
        stats.jobs += size
        alpha = 0.2
        stats.avg_batch_ms = (
            batch_ms if stats.batches == 1 else (1 - alpha) * stats.avg_batch_ms + alpha * batch_ms
        )
        self.client.hset(
            stats_key(self.prefix, self.model),
            mapping={
                "avg_batch_ms": f"{stats.avg_batch_ms:.3f}",
                "avg_batch_size": f"{stats.jobs / stats.batches:.3f}",
                "max_batch_size": str(self.profile.max_batch_size),
            },
        )

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        self.client.set(
            worker_key(self.prefix, self.model, self.consumer.consumer),
            self.runtime.device,
            ex=HEARTBEAT_TTL_S,
        )


def _utc(epoch_s: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC)
