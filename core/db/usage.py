"""Each key's outstanding jobs (queued or running, backfill items not counted).

The quota on them is checked against a counter, ``key_usage.outstanding``,
that moves in the same transaction as the rows it counts: :func:`reserve` when
jobs are inserted, :func:`release` at their terminal write (through
``core.db.terminal.after_terminal``), when a refused job is taken back, or when
a reserved job turns out to be a replay. So it
is exact without counting anything per submission, and :func:`rebuild` (the
reconciler runs it) only repairs what was changed by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, case, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core.db.schema import Job, KeyUsage

log = logging.getLogger(__name__)

OUTSTANDING = ("queued", "running")


def reserve(session: Session, wanted: Mapping[str, int], limit: int | None) -> dict[str, int]:
    """Count ``wanted[key]`` new jobs for each key; how many of them fit under ``limit``.

    The increment comes first and takes the row's lock, so concurrent
    transactions (other API processes) queue behind it and see its result:
    what does not fit is given back at once. The caller inserts the jobs
    admitted in the same transaction.
    """
    admitted: dict[str, int] = {}
    for key_id, count in sorted(wanted.items()):  # one lock order: no deadlock between groups
        now = _upsert(session, key_id, count)
        over = 0 if limit is None else min(count, max(0, now - limit))
        if over:
            _add(session.connection(), key_id, -over)
        admitted[key_id] = count - over
    return admitted


def release(target: Session | Connection, counts: Mapping[str, int]) -> None:
    """Uncount jobs this transaction (``target``'s) made terminal or took back
    (``counts``: per key)."""
    connection = target.connection() if isinstance(target, Session) else target
    for key_id, count in sorted(counts.items()):
        if count:
            _add(connection, key_id, -count)


def release_jobs(session: Session, job_ids: Sequence[str]) -> None:
    """:func:`release` for these jobs (backfill items are not counted)."""
    if not job_ids:
        return
    per_key = session.execute(
        select(Job.api_key_id, func.count())
        .where(Job.id.in_(job_ids), Job.backfill_id.is_(None))
        .group_by(Job.api_key_id)
    ).all()
    release(session, {key_id: int(count) for key_id, count in per_key})


def rebuild(session: Session) -> int:
    """Set every key's counter to its count of outstanding jobs; how many were wrong.

    The first statement locks the counters against every writer (on
    PostgreSQL the table in EXCLUSIVE mode, which readers pass and which
    takes no row locks in an order of its own, so it cannot deadlock with a
    group's or a worker's sorted row locks; on SQLite the database), so the
    count that follows, a statement of its own, sees every transaction that
    moved a counter before it, and none moves one (or adds a key) during it.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("LOCK TABLE key_usage IN EXCLUSIVE MODE"))
    else:
        session.execute(update(KeyUsage).values(outstanding=KeyUsage.outstanding))
    counts = dict(
        session.execute(
            select(Job.api_key_id, func.count())
            .where(Job.status.in_(OUTSTANDING), Job.backfill_id.is_(None))
            .group_by(Job.api_key_id)
        ).all()
    )
    kept = dict(session.execute(select(KeyUsage.api_key_id, KeyUsage.outstanding)).all())
    wrong = 0
    for key_id in sorted(set(counts) | set(kept)):
        actual = int(counts.get(key_id, 0))
        if kept.get(key_id) == actual:
            continue
        wrong += 1
        log.warning(
            "outstanding-jobs counter repaired",
            extra={"key_id": key_id, "was": kept.get(key_id), "now": actual},
        )
        if key_id in kept:
            session.execute(
                update(KeyUsage).where(KeyUsage.api_key_id == key_id).values(outstanding=actual)
            )
        else:
            _upsert(session, key_id, actual)
    return wrong


def _upsert_statement(insert: Any) -> Any:
    adding = insert(KeyUsage).values(api_key_id=bindparam("key_id"), outstanding=bindparam("count"))
    return adding.on_conflict_do_update(
        index_elements=[KeyUsage.api_key_id],
        set_={"outstanding": KeyUsage.outstanding + adding.excluded.outstanding},
    ).returning(KeyUsage.outstanding)


# Built once: every group commit runs one (its construction cost the API more CPU
# than the statement costs the database), on the session's connection, past the
# ORM's handling of statements on mapped classes, which these need none of.
_UPSERTS = {
    "postgresql": _upsert_statement(postgresql.insert),
    "sqlite": _upsert_statement(sqlite.insert),
}
_ADDED = KeyUsage.outstanding + bindparam("delta")
_ADD = (
    update(KeyUsage)
    .where(KeyUsage.api_key_id == bindparam("key_id"))
    .values(outstanding=case((_ADDED < 0, 0), else_=_ADDED))
)


def _upsert(session: Session, key_id: str, count: int) -> int:
    """Add ``count`` to the key's counter (creating it), returning the new value."""
    connection = session.connection()
    statement = _UPSERTS.get(connection.dialect.name, _UPSERTS["sqlite"])
    return int(connection.execute(statement, {"key_id": key_id, "count": count}).scalar_one())


def _add(connection: Connection, key_id: str, delta: int) -> None:
    connection.execute(_ADD, {"key_id": key_id, "delta": delta})
