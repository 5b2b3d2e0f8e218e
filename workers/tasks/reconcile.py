"""The reconciler: re-enqueue accepted jobs whose stream entry is gone.

A job answered with 202 is in the database; its stream entry can still be
lost when Redis restarts without its data or fails over to a replica that had
not seen it. Celery beat runs :func:`reconcile` every ``reconcile_interval_s``:
jobs still ``queued`` or ``running`` that are older than ``reconcile_grace_s``
and have no entry in any of their model's lanes get a new one. The grace
covers the API between its commit and its XADD, so a slow entry is never
doubled. A job enqueued twice is recorded once (the worker's terminal write is
conditional) and never claimed once finished; but one that is running when its
second entry is read can be computed a second time, which the fault suite's
execution record counts (``tests/faults``, "computed twice").

Each run also checks every key's outstanding-jobs counter against the rows
(``core.db.usage.rebuild``).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

import redis
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session, sessionmaker

from core.db.schema import Job
from core.db.usage import rebuild
from core.streams.protocol import JobMessage, Scripts
from core.streams.queues import model_streams

log = logging.getLogger(__name__)

PAGE = 1000


def reconcile(
    sessions: sessionmaker[Session],
    client: redis.Redis,
    prefix: str,
    grace_s: float,
    now: dt.datetime | None = None,
    held: Callable[[], bool] = lambda: True,
) -> int:
    """Re-enqueue lost entries; returns how many jobs were re-enqueued. ``held`` is asked
    before each model and each page (it renews the run's lock): False, and the run stops
    there, another having taken over."""
    cutoff = (now or dt.datetime.now(dt.UTC)) - dt.timedelta(seconds=grace_s)
    with sessions() as session:
        models = list(
            session.scalars(
                select(Job.model)
                .where(Job.status.in_(("queued", "running")), Job.created_at < cutoff)
                .distinct()
            )
        )
    total = 0
    for model in models:
        if not held():
            return total
        # The streams first, then the rows: a job finished in between is then
        # terminal in the rows, never mistaken for a lost one.
        present = _job_ids_in_streams(client, prefix, model)
        missing = [row for row in _open_rows(sessions, model, cutoff) if row.id not in present]
        scripts = Scripts(client)
        for start in range(0, len(missing), PAGE):
            if start and not held():
                return total + start
            pipe = client.pipeline(transaction=False)
            scripts.enqueue_all(
                pipe,
                prefix,
                ((model, JobMessage.of_job(row)) for row in missing[start : start + PAGE]),
            )
            scripts.execute(pipe)
        if missing:
            log.warning(
                "re-enqueued jobs whose stream entry was lost",
                extra={"model": model, "count": len(missing)},
            )
        total += len(missing)
    with sessions() as session:
        # The outstanding-jobs counters move with the rows; this only repairs
        # what was changed by hand (a row edited or deleted in the database).
        rebuild(session)
        session.commit()
    return total


def _open_rows(sessions: sessionmaker[Session], model: str, cutoff: dt.datetime) -> list[Any]:
    """Every queued or running job of the model older than the cutoff, page by page."""
    rows: list[Any] = []
    after: tuple[dt.datetime, str] | None = None
    while True:
        query = select(
            Job.id,
            Job.priority,
            Job.cost,
            Job.created_at,
            Job.deadline_at,
            Job.request_id,
            Job.api_key_id,
            Job.requested_version,
        ).where(Job.model == model, Job.status.in_(("queued", "running")), Job.created_at < cutoff)
        if after is not None:
            query = query.where(
                or_(Job.created_at > after[0], and_(Job.created_at == after[0], Job.id > after[1]))
            )
        with sessions() as session:
            page = session.execute(query.order_by(Job.created_at, Job.id).limit(PAGE)).all()
        rows += page
        if len(page) < PAGE:
            return rows
        after = (page[-1].created_at, page[-1].id)


def _job_ids_in_streams(client: redis.Redis, prefix: str, model: str) -> set[str]:
    """Every job id with an entry in the model's lanes (streams hold only live work)."""
    ids: set[str] = set()
    for stream in model_streams(client, prefix, model):
        start = "-"
        while True:
            page: Any = client.xrange(stream, min=start, max="+", count=PAGE)
            for _entry_id, fields in page:
                job = fields.get("job", fields.get(b"job")) if isinstance(fields, dict) else None
                if job is not None:
                    ids.add(job.decode() if isinstance(job, bytes) else str(job))
            if len(page) < PAGE:
                break
            last = page[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else str(last))
    return ids
