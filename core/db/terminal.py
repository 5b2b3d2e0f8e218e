"""What every terminal write of jobs also does, in the same transaction."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.backfills import count_outcomes
from core.db.schema import Job
from core.db.usage import release
from core.db.webhooks import add_job_deliveries


def after_terminal(session: Session, job_ids: Sequence[str], now: dt.datetime) -> list[str]:
    """Count the jobs into their backfills or out of their keys' outstanding jobs, and
    add their webhook deliveries: one query of the jobs for all three.

    ``job_ids`` are the jobs this transaction just made terminal (its
    conditional UPDATEs won). Returns the new delivery ids, for Celery.
    """
    if not job_ids:
        return []
    rows = session.execute(
        select(Job.id, Job.api_key_id, Job.backfill_id, Job.status, Job.callback_url).where(
            Job.id.in_(job_ids)
        )
    ).all()
    count_outcomes(session, Counter((r.backfill_id, r.status) for r in rows if r.backfill_id))
    release(session, Counter(r.api_key_id for r in rows if r.backfill_id is None))
    called = [r.id for r in rows if r.callback_url]
    return add_job_deliveries(session, called, now) if called else []
