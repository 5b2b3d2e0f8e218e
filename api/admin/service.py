"""What the operator endpoints read, callable without HTTP."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.db.schema import TERMINAL_STATUSES, ApiKey, Job


def outstanding_by_tenant(session: Session) -> list[tuple[str, str, str, str, int]]:
    """Jobs not yet ended, counted by model, key (its id and name) and status."""
    rows = session.execute(
        select(Job.model, Job.api_key_id, ApiKey.name, Job.status, func.count())
        .join(ApiKey, ApiKey.id == Job.api_key_id)
        .where(Job.status.not_in(TERMINAL_STATUSES))
        .group_by(Job.model, Job.api_key_id, ApiKey.name, Job.status)
    ).all()
    return [(model, key_id, name, status, int(n)) for model, key_id, name, status, n in rows]
