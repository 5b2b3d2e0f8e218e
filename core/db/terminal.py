"""What every terminal write of jobs also does, in the same transaction."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from core.db.backfills import count_outcomes
from core.db.schema import Job
from core.db.usage import release
from core.db.webhooks import add_job_deliveries

# What a terminal write's consequences need of each job: a write may return these
# (``RETURNING``) and save the query.
TERMINAL_COLUMNS = (Job.id, Job.api_key_id, Job.backfill_id, Job.status, Job.callback_url)


def after_terminal(
    target: Session | Connection,
    job_ids: Sequence[str],
    now: dt.datetime,
    rows: Sequence[Any] | None = None,
) -> list[str]:
    """Count the jobs into their backfills or out of their keys' outstanding jobs, and
    add their webhook deliveries: one query of the jobs for all three, or none where the
    write returned their :data:`TERMINAL_COLUMNS` (``rows``).

    ``job_ids`` are the jobs this transaction just made terminal (its
    conditional UPDATEs won); ``target``, the session or connection of that
    transaction. Returns the new delivery ids, for Celery.
    """
    if not job_ids:
        return []
    if rows is None:
        rows = target.execute(select(*TERMINAL_COLUMNS).where(Job.id.in_(job_ids))).all()
    count_outcomes(target, Counter((r.backfill_id, r.status) for r in rows if r.backfill_id))
    release(target, Counter(r.api_key_id for r in rows if r.backfill_id is None))
    called = [r.id for r in rows if r.callback_url]
    if not called:
        return []
    if isinstance(target, Session):
        return add_job_deliveries(target, called, now)
    # Deliveries are ORM rows: a session on the connection's transaction, flushed here;
    # the caller commits (or rolls back) the transaction.
    with Session(bind=target, join_transaction_mode="rollback_only") as session:
        deliveries = add_job_deliveries(session, called, now)
        session.flush()
    return deliveries
