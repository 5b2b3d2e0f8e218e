"""The worker's writes to the results table.

Every transition is a conditional UPDATE, so a job that was cancelled, expired
or finished elsewhere is never overwritten: the first terminal write wins.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Row,
    Select,
    String,
    Table,
    Update,
    any_,
    bindparam,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session, sessionmaker

from core.db.schema import TERMINAL_STATUSES, Job
from core.db.terminal import TERMINAL_COLUMNS, after_terminal
from core.db.webhooks import add_progress_deliveries, add_started_deliveries, wants

_JOBS = cast(Table, Job.__table__)

# The claim's statements, built once (per batch they cost the worker more to build than
# to run), on the table: no ORM evaluation of the session's objects after the UPDATE. On
# PostgreSQL the ids are one array parameter and the terminal statuses literals, so the
# statement is the same text whatever the batch's size (an expanding IN is rendered anew
# for each execution, and prepared once per size); SQLite has no arrays.
_NOT_ENDED = text(
    "jobs.status NOT IN (" + ", ".join(f"'{status}'" for status in TERMINAL_STATUSES) + ")"
)
_CLAIMED = (_JOBS.c.id, _JOBS.c.input, _JOBS.c.attempts)
# A generation worker's: what its started webhooks need too.
_CLAIMED_HOOKS = (
    *_CLAIMED,
    _JOBS.c.api_key_id,
    _JOBS.c.model,
    _JOBS.c.callback_url,
    _JOBS.c.callback_events,
)
_NOW = bindparam("now", type_=_JOBS.c.started_at.type)


@dataclass(frozen=True)
class _ClaimStatements:
    """The claim is one UPDATE of the rows that may start, returning them: a batch whose
    jobs all start (nearly every one) costs one statement, and no row lock of a read
    before it (a write of each row's page of its own). Only when fewer come back are the
    others read, to say why each did not start."""

    # By (hold_started: only jobs never started before, webhooks: with what a generation
    # worker's started webhooks need).
    claims: dict[tuple[bool, bool], Update]
    unclaimed: Select[Any]


def _claim_statements(ids: ColumnElement[bool]) -> _ClaimStatements:
    def claim(first_only: bool, hooks: bool) -> Update:
        may_start: list[ColumnElement[bool]] = [
            ids,
            cast(ColumnElement[bool], _NOT_ENDED),
            or_(_JOBS.c.deadline_at.is_(None), _JOBS.c.deadline_at > _NOW),
            _JOBS.c.attempts < bindparam("max_attempts"),
        ]
        if first_only:
            may_start.append(_JOBS.c.attempts == 0)
        return (
            update(_JOBS)
            .where(*may_start)
            .values(
                status="running",
                started_at=_NOW,
                attempts=_JOBS.c.attempts + 1,
                model_version=bindparam("version", type_=_JOBS.c.model_version.type),
            )
            .returning(*(_CLAIMED_HOOKS if hooks else _CLAIMED))
        )

    return _ClaimStatements(
        claims={
            (first, hooks): claim(first, hooks)
            for first in (False, True)
            for hooks in (False, True)
        },
        unclaimed=select(_JOBS.c.id, _JOBS.c.attempts, _JOBS.c.deadline_at).where(ids, _NOT_ENDED),
    )


_CLAIMS = {
    "postgresql": _claim_statements(
        _JOBS.c.id == any_(bindparam("ids", type_=postgresql.ARRAY(String)))
    ),
    "sqlite": _claim_statements(_JOBS.c.id.in_(bindparam("ids", expanding=True))),
}

# A batch's outcomes in one statement whatever the batch's size (the same text
# every time, so the driver prepares it once), instead of one per job, which
# would cost the recording more than the batch took to compute. Only a job not
# yet terminal is written: the first terminal write wins. PostgreSQL: the outcomes
# as one JSON document (one parameter for the driver to adapt, where an array per
# column cost the worker more than the statement's own work here), each output in it
# as the JSON text json.dumps gave it, stored as that text, as the JSON column's own
# writes make it. (Not as a JSON value: json_to_recordset turns each value to text on
# the way, and a generation's text may hold a NUL, which PostgreSQL's JSON accepts
# as ``\u0000`` and its text refuses.) ``jobs.id = ANY(...)`` says again
# what the join says, so that the plan finds the rows by primary key whatever the
# statistics: the prepared statement's generic plan guesses a fixed number of rows
# from a set-returning function, and on an analyzed table of 1,500 jobs it once chose
# a nested loop over every row (12.8 ms a batch of 32, against 0.7 ms by the index).
# What the consequences of a terminal write need (core.db.terminal), returned by it.
_RETURNING = ", ".join(f"jobs.{column.name}" for column in TERMINAL_COLUMNS)
_PG_FINISH = text(
    f"""
    WITH o AS MATERIALIZED (
        SELECT * FROM json_to_recordset(CAST(:rows AS json))
            AS o (id text, status text, output text, error text, inference_ms double precision)
    )
    UPDATE jobs SET status = o.status, output = CAST(o.output AS json),
        error = o.error, inference_ms = o.inference_ms, finished_at = :now,
        batch_id = :batch_id, batch_size = :batch_size
    FROM o
    WHERE jobs.id = ANY(ARRAY(SELECT id FROM o)) AND jobs.id = o.id AND {_NOT_ENDED.text}
    RETURNING {_RETURNING}
    """
).bindparams(bindparam("now", type_=_JOBS.c.finished_at.type))
# SQLite (3.35 or newer, for RETURNING): a JSON array of [id, status, output
# JSON text, error, inference_ms] rows; each row finds its job by primary key.
_SQLITE_FINISH = text(
    f"""
    UPDATE jobs SET status = json_extract(o.value, '$[1]'),
        output = json_extract(o.value, '$[2]'), error = json_extract(o.value, '$[3]'),
        inference_ms = json_extract(o.value, '$[4]'), finished_at = :now,
        batch_id = :batch_id, batch_size = :batch_size
    FROM json_each(:rows) AS o
    WHERE jobs.id = json_extract(o.value, '$[0]')
        AND {_NOT_ENDED.text}
    RETURNING {_RETURNING}
    """
).bindparams(bindparam("now", type_=_JOBS.c.finished_at.type))


def _batched_writes(dialect: str) -> bool:
    """Whether this database takes a batch's outcomes in one statement."""
    return dialect == "postgresql" or (
        dialect == "sqlite" and sqlite3.sqlite_version_info >= (3, 35)
    )


@dataclass(frozen=True)
class Claimed:
    job_id: str
    input: Any
    attempts: int
    progress: bool = False  # it asked for progress webhooks (claimed with ``webhooks``)


class Claim(NamedTuple):
    claimed: list[Claimed]
    late: list[str]  # past their deadline
    exhausted: list[str]  # started max_attempts times
    held: list[str]  # started before and never finished, left unclaimed (hold_started)


class _Found(NamedTuple):
    """A claim's rows (what its UPDATE returned), and the ids of each other kind."""

    claimed: list[Row[Any]]
    late: list[str]
    exhausted: list[str]
    held: list[str]


@dataclass(frozen=True)
class Outcome:
    job_id: str
    status: str  # succeeded | failed | expired
    output: Any = None
    error: str | None = None
    inference_ms: float | None = None


class Recorder:
    def __init__(self, sessions: sessionmaker[Session], model_version: int | None = None) -> None:
        self.sessions = sessions
        bind = sessions.kw.get("bind")
        if not isinstance(bind, Engine):
            raise TypeError("a Recorder's sessionmaker must be bound to an Engine")
        # Claims and outcomes are written in Core transactions of its own (an ORM
        # session only where the ORM's rows are added: webhook deliveries).
        self._engine = bind
        # Written on every job this worker claims: the version that ran it.
        self.model_version = model_version
        # Webhook deliveries committed with outcomes, not yet handed to Celery.
        # The loop's recording thread and its main thread both write outcomes.
        self.outbox: list[str] = []
        self._outbox_lock = threading.Lock()

    def take_outbox(self) -> list[str]:
        with self._outbox_lock:
            taken, self.outbox = self.outbox, []
        return taken

    def claim(
        self,
        job_ids: Sequence[str],
        now: dt.datetime,
        max_attempts: int,
        webhooks: bool = False,
        hold_started: bool = False,
    ) -> Claim:
        """Mark the jobs running.

        Returns the jobs claimed, the ids past their deadline, and the ids that
        already started ``max_attempts`` times (a job that keeps killing its
        worker must not be run forever). Jobs that are missing or already
        terminal (cancelled, say) are in no list: the caller acknowledges their
        entries and drops them. ``webhooks`` (a generation worker's claim):
        the ``job.started`` webhooks the claimed jobs asked for are added in the
        same transaction (to :attr:`outbox`), and each says whether it asked
        for progress ones. ``hold_started``: the jobs started before and never
        finished (one may be what killed a worker) are left unclaimed, in
        ``held``, to run alone, each claimed then.
        """
        ids = list(dict.fromkeys(job_ids))
        deliveries: list[str] = []
        if webhooks:
            with self.sessions.begin() as session:
                found = self._claim(
                    session.connection(), ids, now, max_attempts, True, hold_started
                )
                starting = [(r, r.attempts) for r in found.claimed if r.callback_url]
                deliveries = add_started_deliveries(session, starting, now)
        else:
            # No ORM session where nothing but the claim's statements runs: a Core
            # transaction costs the worker about a tenth less per claim (a probe: 866
            # against 984 µs of its CPU a claim of 32, eight rounds).
            with self._engine.begin() as connection:
                found = self._claim(connection, ids, now, max_attempts, False, hold_started)
        if deliveries:
            with self._outbox_lock:
                self.outbox += deliveries
        return Claim(
            [
                Claimed(
                    r.id,
                    r.input,
                    r.attempts,
                    progress=webhooks
                    and bool(r.callback_url)
                    and wants(r.callback_events, "progress"),
                )
                for r in found.claimed
            ],
            found.late,
            found.exhausted,
            found.held,
        )

    def _claim(
        self,
        connection: Connection,
        ids: list[str],
        now: dt.datetime,
        max_attempts: int,
        webhooks: bool,
        hold_started: bool,
    ) -> _Found:
        """:meth:`claim`'s statements on ``connection``: the claimed jobs' rows, in
        ``ids``' order, and the ids of each other kind."""
        statements = _CLAIMS.get(connection.dialect.name, _CLAIMS["sqlite"])
        claim = statements.claims[hold_started, webhooks]
        parameters = {"now": now, "max_attempts": max_attempts, "version": self.model_version}
        by_id = {r.id: r for r in connection.execute(claim, {"ids": ids, **parameters}).all()}
        late: list[str] = []
        exhausted: list[str] = []
        held: list[str] = []
        rest = [i for i in ids if i not in by_id]
        if rest:
            # Not ended and not started: why, tested in the claim's order. One that
            # may start after all (this read sees a later state than the claim did:
            # a deadline never moves and attempts only grow, so it should not
            # happen) is claimed again rather than dropped with the ended ones.
            again = []
            for r in connection.execute(statements.unclaimed, {"ids": rest}).all():
                if r.deadline_at is not None and r.deadline_at <= now:
                    late.append(r.id)
                elif r.attempts >= max_attempts:
                    exhausted.append(r.id)
                elif hold_started and r.attempts > 0:
                    held.append(r.id)
                else:
                    again.append(r.id)
            if again:
                by_id.update(
                    (r.id, r) for r in connection.execute(claim, {"ids": again, **parameters})
                )
        return _Found([by_id[i] for i in ids if i in by_id], late, exhausted, held)

    def progress(self, tokens: dict[str, tuple[int, int]], now: dt.datetime) -> None:
        """Add a ``job.progress`` webhook for each running job of ``tokens`` (its tokens so
        far and its max_tokens), to :attr:`outbox`."""
        with self.sessions.begin() as session:
            deliveries = add_progress_deliveries(session, tokens, now)
        if deliveries:
            with self._outbox_lock:
                self.outbox += deliveries

    def finish(
        self,
        outcomes: Sequence[Outcome],
        now: dt.datetime,
        batch_id: str | None,
        batch_size: int | None,
    ) -> list[str]:
        """Record every outcome in one transaction; returns the ids actually written.

        The same transaction counts the jobs written into their backfills and
        adds the webhook deliveries of those with a callback URL (their ids go
        to :attr:`outbox`).
        """
        if not outcomes:
            return []
        written: list[str] = []
        with self._engine.begin() as connection:
            dialect = connection.dialect.name
            if _batched_writes(dialect):
                common = {"now": now, "batch_id": batch_id, "batch_size": batch_size}
                if dialect == "postgresql":
                    document = json.dumps(
                        [
                            {
                                "id": o.job_id,
                                "status": o.status,
                                "output": json.dumps(o.output),
                                "error": o.error,
                                "inference_ms": o.inference_ms,
                            }
                            for o in outcomes
                        ]
                    )
                    won = connection.execute(_PG_FINISH, {"rows": document} | common).all()
                else:
                    rows = [
                        [o.job_id, o.status, json.dumps(o.output), o.error, o.inference_ms]
                        for o in outcomes
                    ]
                    won = connection.execute(
                        _SQLITE_FINISH, {"rows": json.dumps(rows)} | common
                    ).all()
                # In the outcomes' order, once each (a job may have two entries).
                ids = {row.id for row in won}
                written = list(dict.fromkeys(o.job_id for o in outcomes if o.job_id in ids))
                # The rows written say what follows a terminal write: no query for it.
                deliveries = after_terminal(connection, written, now, won)
            else:
                statement = (
                    update(_JOBS)
                    .where(
                        _JOBS.c.id == bindparam("b_id"),
                        _JOBS.c.status.not_in(TERMINAL_STATUSES),
                    )
                    .values(
                        status=bindparam("b_status"),
                        output=bindparam("b_output"),
                        error=bindparam("b_error"),
                        inference_ms=bindparam("b_inference_ms"),
                        finished_at=now,
                        batch_id=batch_id,
                        batch_size=batch_size,
                    )
                )
                # One statement per row, each telling by its row count whether
                # its write won.
                for outcome in outcomes:
                    result = connection.execute(
                        statement,
                        {
                            "b_id": outcome.job_id,
                            "b_status": outcome.status,
                            "b_output": outcome.output,
                            "b_error": outcome.error,
                            "b_inference_ms": outcome.inference_ms,
                        },
                    )
                    if result.rowcount:
                        written.append(outcome.job_id)
                deliveries = after_terminal(connection, written, now)
        with self._outbox_lock:
            self.outbox += deliveries
        return written
