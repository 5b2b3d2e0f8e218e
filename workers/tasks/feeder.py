"""The backfill feeder: waiting jobs into their model's bulk lane, never too many.

Celery beat starts :func:`feed` every ``backfill_feed_interval_s``; one run
(one at a time, by a Redis lock that it keeps renewing) loops for up to
``backfill_feed_budget_s``. Per model it keeps the bulk lane's live entries
(the stream holds only unacknowledged work: workers delete what they
acknowledge) between half of ``backfill_outstanding`` and all of it, so the
lane never runs dry while workers have capacity and Redis never holds a whole
dataset. Interactive lanes are read first by the workers, so a backfill only
uses the capacity they leave.

Feeding is resumable: a chunk's jobs go from ``waiting`` to ``queued`` in one
transaction with the backfill's cursor, then get their stream entries. If the
feeder dies in between, the reconciler gives those queued jobs their entries
(their ``created_at`` is the moment they were queued, so its grace applies).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field

import redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from core.db.backfills import count_outcomes, discard
from core.db.schema import BACKFILL_ACTIVE, WAITING, Backfill, Job, utcnow
from core.db.webhooks import add_backfill_delivery
from core.ops.metrics import JOBS_FINISHED
from core.streams.protocol import JobMessage, Scripts, done_channel
from core.streams.queues import tenant_depths
from core.streams.target import REDIS_ERRORS
from scheduler.vocabulary import Lane
from workers.tasks.locks import release, renew

log = logging.getLogger(__name__)

# An ending backfill's status -> the status of its lines that never ran, and its own at the end.
ENDING = {"cancelling": "cancelled", "expiring": "expired"}
SETTLED_BECAUSE = {
    "cancelled": "the backfill was cancelled",
    "expired": "the backfill's completion window ended before this line ran",
}
LOCK_S = 15.0  # renewed every loop; a dead feeder's lock is free this soon
SWEEP_EVERY_S = 30.0
CANCEL_CHUNK = 5000


@dataclass(eq=False)
class Feeder:
    sessions: sessionmaker[Session]
    client: redis.Redis
    prefix: str
    _: KW_ONLY
    outstanding: int
    chunk: int
    stale_upload_s: float
    kick: Callable[[Sequence[str]], None] | None = None
    clock: Callable[[], dt.datetime] = utcnow
    _last_sweep: float = field(default=0.0, init=False, repr=False)

    def run(self, budget_s: float, poll_s: float = 0.05) -> int:
        """Feed for up to ``budget_s`` (only one run at a time); returns jobs queued."""
        lock = f"{self.prefix}:backfills:feeder"
        token = uuid.uuid4().hex
        if not self.client.set(lock, token, nx=True, px=int(LOCK_S * 1000)):
            return 0  # another run is feeding
        queued = 0
        try:
            until = time.monotonic() + budget_s
            while True:
                active, fed = self.step()
                queued += fed
                if not active or time.monotonic() >= until:
                    return queued
                if not renew(self.client, lock, token, int(LOCK_S * 1000)):
                    return queued  # our lock expired and another run took over
                if not fed:
                    time.sleep(poll_s)
        finally:
            release(self.client, lock, token)

    def step(self) -> tuple[bool, int]:
        """One pass: feed, cancel, finish. Returns (any backfill active, jobs queued)."""
        if time.monotonic() - self._last_sweep > SWEEP_EVERY_S:
            self._last_sweep = time.monotonic()
            self.sweep_stale_uploads()
        with self.sessions() as session:
            active = list(
                session.scalars(
                    select(Backfill)
                    .where(Backfill.status.in_(BACKFILL_ACTIVE))
                    .order_by(Backfill.created_at)
                )
            )
        fed = 0
        by_model: dict[str, list[Backfill]] = defaultdict(list)
        for backfill in active:
            if backfill.status == "in_progress" and self._window_ended(backfill):
                self._start_expiring(backfill)
            if backfill.status in ENDING:
                self._settle_waiting(backfill, ENDING[backfill.status])
            elif backfill.fed_through < self._last_line(backfill):
                by_model[backfill.model].append(backfill)
        for model, backfills in by_model.items():
            room = self.outstanding - self._live(model)
            if room < min(self.chunk, self.outstanding) // 2:
                continue  # the lane is full enough
            # Share the room: the oldest backfill first, each at most a chunk a pass.
            for backfill in backfills:
                if room <= 0:
                    break
                count = self._feed(backfill, min(room, self.chunk))
                fed += count
                room -= count
        for backfill in active:
            # Counts read at the start of this pass: a running backfill that
            # just got there is finished on the next pass, without a
            # transaction per pass for each one still running. A cancelling one
            # was just settled above: look now.
            if backfill.status in ENDING or backfill.done >= backfill.total:
                self._maybe_finish(backfill.id)
        return bool(active), fed

    def _live(self, model: str) -> int:
        return sum(tenant_depths(self.client, self.prefix, model)[Lane.BULK].values())

    def _last_line(self, backfill: Backfill) -> int:
        with self.sessions() as session:
            last = session.scalar(
                select(Job.line_no)
                .where(Job.backfill_id == backfill.id)
                .order_by(Job.line_no.desc())
                .limit(1)
            )
        return int(last or 0)

    def _feed(self, backfill: Backfill, limit: int) -> int:
        now = self.clock()
        with self.sessions.begin() as session:
            rows = session.execute(
                select(Job.id, Job.line_no, Job.cost)
                .where(
                    Job.backfill_id == backfill.id,
                    Job.line_no > backfill.fed_through,
                    Job.status == WAITING,
                )
                .order_by(Job.line_no)
                .limit(limit)
            ).all()
            # No row: every line after the cursor was settled otherwise (cancelled).
            through = rows[-1].line_no if rows else self._last_line(backfill)
            moved = session.execute(
                update(Backfill)
                .where(Backfill.id == backfill.id, Backfill.fed_through == backfill.fed_through)
                .values(fed_through=through)
            )
            if not moved.rowcount:  # type: ignore[attr-defined]
                return 0  # fed by someone else meanwhile: read again next pass
            ids = [r.id for r in rows]
            if ids:
                session.execute(
                    update(Job)
                    .where(Job.id.in_(ids), Job.status == WAITING)
                    .values(status="queued", created_at=now)
                )
        backfill.fed_through = through
        if not rows:
            return 0
        enqueued_at_ms = int(now.timestamp() * 1000)
        scripts = Scripts(self.client)
        pipe = self.client.pipeline(transaction=False)
        scripts.enqueue_all(
            pipe,
            self.prefix,
            (
                (
                    backfill.model,
                    JobMessage(
                        job_id=row.id,
                        lane=Lane.BULK,
                        cost=row.cost,
                        enqueued_at_ms=enqueued_at_ms,
                        deadline_at_ms=None,
                        request_id=None,
                        tenant=backfill.api_key_id,
                    ),
                )
                for row in rows
            ),
        )
        scripts.execute(pipe)
        return len(rows)

    def _window_ended(self, backfill: Backfill) -> bool:
        return backfill.expires_at is not None and self.clock() >= backfill.expires_at

    def _start_expiring(self, backfill: Backfill) -> None:
        """The backfill's window ended: what has not started will be expired."""
        with self.sessions.begin() as session:
            moved = session.execute(
                update(Backfill)
                .where(Backfill.id == backfill.id, Backfill.status == "in_progress")
                .values(status="expiring", updated_at=self.clock())
            )
        if moved.rowcount:  # type: ignore[attr-defined]
            backfill.status = "expiring"
            log.info("backfill window ended; expiring", extra={"backfill_id": backfill.id})

    def _settle_waiting(self, backfill: Backfill, status: str) -> None:
        """An ending backfill: its jobs not yet running become ``status`` (cancelled or
        expired), a chunk at a time.

        Walks the lines in order, so each chunk reads only lines not yet seen.
        """
        now = self.clock()
        why = SETTLED_BECAUSE[status]
        after = 0
        while True:
            with self.sessions.begin() as session:
                rows = session.execute(
                    select(Job.id, Job.line_no)
                    .where(
                        Job.backfill_id == backfill.id,
                        Job.line_no > after,
                        Job.status.in_((WAITING, "queued")),
                    )
                    .order_by(Job.line_no)
                    .limit(CANCEL_CHUNK)
                ).all()
                if not rows:
                    return
                after = rows[-1].line_no
                result = session.execute(
                    update(Job)
                    .where(Job.id.in_([r.id for r in rows]), Job.status.in_((WAITING, "queued")))
                    .values(status=status, finished_at=now, error=why)
                )
                count = int(result.rowcount)  # type: ignore[attr-defined]
                count_outcomes(session, {(backfill.id, status): count})
            JOBS_FINISHED.labels(backfill.model, Lane.BULK, status).inc(count)
            # Long-polls of the cancelled items wake as they do for a worker's result.
            with contextlib.suppress(*REDIS_ERRORS):
                self.client.publish(done_channel(self.prefix), ",".join(r.id for r in rows))

    def _maybe_finish(self, backfill_id: str) -> None:
        now = self.clock()
        delivery: str | None = None
        with self.sessions.begin() as session:
            backfill = session.get(Backfill, backfill_id, with_for_update=True)
            if backfill is None or backfill.status not in BACKFILL_ACTIVE:
                return
            if backfill.done < backfill.total:
                return
            if backfill.status in ENDING:
                backfill.status = ENDING[backfill.status]
            else:
                # Every result is recorded; nothing is left to assemble (results
                # are read from the jobs), so finalizing is a moment long.
                backfill.finalizing_at = now
                backfill.status = "completed"
            backfill.finished_at = now
            backfill.updated_at = now
            session.flush()
            delivery = add_backfill_delivery(session, backfill, now)
            log.info(
                "backfill finished",
                extra={
                    "backfill_id": backfill.id,
                    "status": backfill.status,
                    "total": backfill.total,
                },
            )
        if delivery and self.kick is not None:
            self.kick([delivery])

    def sweep_stale_uploads(self) -> None:
        """Uploads cut off mid-way (the API stopped) are marked failed and their lines deleted."""
        cutoff = self.clock() - dt.timedelta(seconds=self.stale_upload_s)
        with self.sessions() as session:
            stale = list(
                session.scalars(
                    select(Backfill.id).where(
                        Backfill.status == "validating", Backfill.updated_at < cutoff
                    )
                )
            )
        for backfill_id in stale:
            log.warning("upload never finished; failed", extra={"backfill_id": backfill_id})
            discard(self.sessions, backfill_id, "the upload was interrupted before its end")
