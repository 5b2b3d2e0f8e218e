"""What every terminal write of jobs also does, in the same transaction."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy.orm import Session

from core.backfills import count_outcomes
from core.webhooks import add_job_deliveries


def after_terminal(session: Session, job_ids: Sequence[str], now: dt.datetime) -> list[str]:
    """Count the jobs into their backfills and add their webhook deliveries.

    ``job_ids`` are the jobs this transaction just made terminal (its
    conditional UPDATEs won). Returns the new delivery ids, for Celery.
    """
    count_outcomes(session, job_ids)
    return add_job_deliveries(session, job_ids, now)
