"""The recording of outcomes: claim, write, acknowledge, in that order.

An entry is acknowledged only after its job's outcome is committed (or after
it was found to need no run: cancelled, missing, already finished). A result
write that the database refuses fails its job alone; one that cannot reach
the database is retried, the entries kept ours meanwhile, until the drain
time of a stopping worker runs out (then they stay unacknowledged and run
again). Pipelined, batch N is recorded on a thread of its own while batch
N + 1 computes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, StatementError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from core.streams.protocol import done_channel
from core.streams.target import REDIS_ERRORS
from workers.gpu.consumer import Entry
from workers.gpu.events import BatchObserver, JobDone
from workers.gpu.intake import Intake
from workers.gpu.pipelined import Pipelined
from workers.gpu.recorder import Claimed, Outcome, Recorder

log = logging.getLogger(__name__)
# The note an acknowledgement's error carries: the batch's results were committed.
ACKNOWLEDGE_FAILED = "the results were recorded; their entries were not acknowledged"

RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0


def retry_extra(model: str, exc: BaseException, backoff_s: float) -> dict[str, object]:
    """The log fields of an outage that is waited out for ``backoff_s`` before a retry."""
    return {"model": model, "error_type": type(exc).__name__, "retry_in_s": backoff_s}


def connection_lost(exc: BaseException) -> bool:
    """Whether a write failed for want of its connection, not for what it wrote.

    Besides the driver's connection errors, the server may end the session
    itself: a worker stopped inside a transaction past PostgreSQL's
    idle-in-transaction timeout finds, resumed, an error of another class
    whose connection SQLAlchemy has invalidated. Its write is retried, not
    refused as a bad value.
    """
    return isinstance(exc, (OperationalError, InterfaceError, PoolTimeout)) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    )


class Drain:
    """A worker's stop: asked for once, then ``drain_s`` to finish what it holds."""

    def __init__(self, drain_s: float) -> None:
        self.drain_s = drain_s
        self.stop = threading.Event()
        self._requested_at: float | None = None

    def request(self) -> None:
        if self._requested_at is None:
            self._requested_at = time.monotonic()
        self.stop.set()

    def left_s(self) -> float | None:
        """Seconds left to finish after a stop was asked for (None: not stopping)."""
        if not self.stop.is_set():
            return None
        if self._requested_at is None:
            self._requested_at = time.monotonic()
        return self._requested_at + self.drain_s - time.monotonic()


@dataclass(eq=False)
class Recording:
    """Writes outcomes through ``recorder`` and acknowledges their entries through ``intake``."""

    model: str
    recorder: Recorder
    intake: Intake
    observer: BatchObserver
    drain: Drain
    _: KW_ONLY
    prefix: str
    max_attempts: int
    pipeline: InitVar[bool]
    clock: Callable[[], float] = time.time
    # Terminal statuses written and not yet acknowledged, for the observers.
    _written_status: dict[str, str] = field(init=False, repr=False, default_factory=dict)
    _recording: Pipelined[None] = field(init=False, repr=False)

    def __post_init__(self, pipeline: bool) -> None:
        # Pipelined: one thread records batch N (result write, acknowledgement,
        # webhooks) while the loop's computes batch N + 1.
        self._recording = Pipelined(f"record-{self.model}", pipeline)

    # --- before a batch runs ---------------------------------------------------

    def claim(
        self, entries: list[Entry], hold_started: bool = False
    ) -> tuple[list[Claimed], list[str], list[str]]:
        """Mark the entries' jobs running; settle those that will not run.

        Returns the jobs claimed, in order, the jobs settled instead (past
        their deadline, or out of attempts: dead-lettered), and, with
        ``hold_started``, the jobs started before and never finished, left
        unclaimed (each to run alone: one may be what killed a worker).
        """
        by_job = {e.message.job_id: e for e in entries}
        claimed, late, exhausted, held = self.recorder.claim(
            list(by_job), utc_at(self.clock()), self.max_attempts, hold_started=hold_started
        )
        written = self.settle_unrunnable(
            late, [by_job[job_id] for job_id in exhausted], "the deadline passed before it started"
        )
        return claimed, written, held

    def expire(self, entries: list[Entry]) -> None:
        written = self.settle_unrunnable(
            [e.message.job_id for e in entries], [], "the deadline cannot be met"
        )
        self.acknowledge(entries, written)
        log.info("jobs expired", extra={"model": self.model, "count": len(written)})

    def settle_unrunnable(self, late: list[str], exhausted: list[Entry], why: str) -> list[str]:
        """Record the jobs a batch will not run: past their deadline, or out of attempts."""
        outcomes = [Outcome(job_id, "expired", error=why) for job_id in late]
        if exhausted:
            self.intake.consumer.dead_letter(exhausted)
            self.observer.jobs_dead_lettered([e.message for e in exhausted])
            outcomes += [
                Outcome(
                    e.message.job_id,
                    "failed",
                    error=f"gave up after {self.max_attempts} attempts "
                    "(the worker stopped while running it each time)",
                )
                for e in exhausted
            ]
        return self.record(outcomes, utc_at(self.clock()), None, None, exhausted)

    # --- writing ---------------------------------------------------------------

    def record(
        self,
        outcomes: list[Outcome],
        now: dt.datetime,
        batch_id: str | None,
        batch_size: int | None,
        entries: list[Entry],
    ) -> list[str]:
        """Write the outcomes; remember what was written, for the observers."""
        began = time.perf_counter()
        written = self._write(
            outcomes, lambda some: self.recorder.finish(some, now, batch_id, batch_size), entries
        )
        if outcomes:
            self.observer.stage_timed("record", time.perf_counter() - began, batch_id)
        done = set(written)
        for outcome in outcomes:
            if outcome.job_id in done:
                self._written_status[outcome.job_id] = outcome.status
        return written

    def _write(
        self,
        outcomes: list[Outcome],
        finish: Callable[[list[Outcome]], list[str]],
        entries: list[Entry],
    ) -> list[str]:
        """Write the outcomes through ``finish``; one the database refuses to store fails on
        its own."""
        try:
            return self._durably(lambda: finish(outcomes), entries)
        except StatementError as exc:
            if connection_lost(exc):
                raise  # unreachable past the drain time: leave it unacknowledged
            if len(outcomes) == 1:
                log.error(
                    "result could not be stored; the job fails",
                    extra={
                        "model": self.model,
                        "job_id": outcomes[0].job_id,
                        "error_type": type(exc).__name__,
                    },
                )
                failed = Outcome(
                    outcomes[0].job_id,
                    "failed",
                    error=f"the result could not be stored ({type(exc).__name__})",
                )
                return self._durably(lambda: finish([failed]), entries)
            written: list[str] = []
            for outcome in outcomes:
                written += self._write([outcome], finish, entries)
            return written

    def _durably(self, write: Callable[[], list[str]], entries: list[Entry]) -> list[str]:
        """Retry a result write while the database is unreachable; acknowledge nothing meanwhile.

        Only connection failures are retried (a value the database refuses is
        not going to be stored by trying again). The entries are kept ours
        while waiting. A stopping worker gives up ``drain_s`` after the stop was
        asked for: its entries stay unacknowledged and are run again.
        """
        backoff_s = RETRY_MIN_S
        while True:
            try:
                return write()
            except (StatementError, PoolTimeout) as exc:
                if not connection_lost(exc):
                    raise
                left_s = self.drain.left_s()
                if left_s is not None and left_s <= 0:
                    raise
                log.warning(
                    "database unavailable; retrying the result write",
                    extra=retry_extra(self.model, exc, backoff_s),
                )
                self.drain.stop.wait(backoff_s if left_s is None else min(backoff_s, left_s))
                backoff_s = min(backoff_s * 2, RETRY_MAX_S)
                with contextlib.suppress(*REDIS_ERRORS):
                    self.intake.consumer.touch(entries)

    def acknowledge(
        self, entries: list[Entry], written: list[str], batch_id: str | None = None
    ) -> None:
        """Acknowledge entries whose outcomes are committed; then tell the observers."""
        # The long-polls of the finished jobs are woken in the same round trip.
        done = (done_channel(self.prefix), ",".join(written)) if written else None
        began = time.perf_counter()
        try:
            self.intake.acknowledge(entries, publish=done)
        except Exception as exc:
            # Whoever logs it says so: the results are committed, only the entries stay.
            exc.add_note(ACKNOWLEDGE_FAILED)
            raise
        self.observer.stage_timed("acknowledge", time.perf_counter() - began, batch_id)
        by_job = {e.message.job_id: e.message for e in entries}
        finished = [
            JobDone(by_job[job_id], self._written_status.pop(job_id, "succeeded"))
            for job_id in written
            if job_id in by_job
        ]
        for job_id in written:
            self._written_status.pop(job_id, None)
        if finished:
            self.observer.jobs_finished(finished, batch_id, self.clock())
        # Webhooks go out only after the results are committed and acknowledged.
        deliveries = self.recorder.take_outbox()
        if deliveries:
            self.observer.deliveries_created(deliveries)

    # --- the recording thread --------------------------------------------------

    def hand_over(self, finish: Callable[[], None]) -> None:
        """Record the batch now, or, pipelined, on the recording thread while the next one runs.

        One batch at most is being recorded while another computes: before
        handing over, the previous recording must be done, and an error it
        raised (the database gone) is raised here, in the loop.
        """
        try:
            self.wait()
        finally:
            # Recorded even when the previous recording failed: this batch ran,
            # and its own recording may well succeed (the loop then waits for
            # it before reading the streams again).
            self._recording.submit(finish)

    def wait(self) -> None:
        """Until the batch being recorded is; re-raises what its recording raised."""
        self._recording.wait()

    def done_recording(self) -> bool:
        """A recording was handed over and has ended (well or not)."""
        return self._recording.done()

    def close(self) -> None:
        self._recording.close()


def acknowledge_failed(exc: BaseException) -> bool:
    """Whether ``exc`` was raised acknowledging a batch whose results were committed."""
    return ACKNOWLEDGE_FAILED in getattr(exc, "__notes__", ())


def utc_at(epoch_s: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC)
