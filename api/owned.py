"""A calling key's own rows: the lookup every resource's service shares.

Another key's row answers exactly as a missing one does (404), so that ids
leak nothing about other tenants.
"""

from __future__ import annotations

import uuid
from typing import TypeVar

from sqlalchemy.orm import Session

from api.errors import ApiError
from core.db.schema import ApiKey, Backfill, Job

Owned = TypeVar("Owned", Job, Backfill)


def owned(session: Session, kind: type[Owned], key: ApiKey, row_id: str, noun: str) -> Owned:
    """The calling key's row of this kind, or a 404."""
    row = session.get(kind, row_id) if is_uuid(row_id) else None
    if row is None or row.api_key_id != key.id:
        raise ApiError(404, "not_found", f"no {noun} {row_id!r}")
    return row


def is_uuid(value: str) -> bool:
    """Whether ``value`` is an id as Ferry writes them (a UUID in its canonical form)."""
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False
