"""A group's new jobs and their keys' outstanding counters in one PostgreSQL statement.

The group commit's transaction (``api.jobs.submissions``) is four round trips on
PostgreSQL: BEGIN, the counter's upsert, the multi-row INSERT, COMMIT; with
SQLAlchemy's ORM session around them, that was most of the API's CPU per
submission. Here the same writes are one statement, run in autocommit (one
statement is one transaction): the rows sent as one JSON array, read by
``json_populate_recordset`` into the jobs table's own row type, so the
statement's text never changes (the driver prepares it once) and the group is
one parameter, encoded by :func:`json.dumps`. (Sent as one array per column,
the driver's adaptation of each list cost the API more CPU than the rest of the
statement's work in this process: about 90 µs a submission more, and no less
of the database's.)

Within the statement, in this order:

1. each key's counter (``key_usage``) is locked, ``FOR UPDATE`` in key order
   (the lock order every writer of counters keeps), so concurrent groups of a
   key, from any API process, queue behind each other and each sees the count
   the one before left;
2. a key's new jobs are numbered in the group's order, and those that fit
   under the limit (``limit - outstanding``) are inserted; a row whose
   idempotency key another request committed is skipped (``ON CONFLICT DO
   NOTHING``);
3. each counter is moved by the rows actually inserted.

What it returns says, for each candidate, which of those happened:
:func:`write` classifies them. A key with no counter row yet (a key's first
job) gets none of its rows in: the caller creates the row and sends those
again. The quota is as exact as the transaction's: a key's counter never
passes the limit, and what is refused would not have fit.

A group of one key's jobs, none with an idempotency key (a busy tenant's, the
usual group), is first sent as a leaner statement (:data:`ONE_KEY`): the key's
counter moved by the group's size where all of it fits, and the rows inserted
only if it moved. Without the numbering, the joins and the lock taken before the
counter's update, it costs PostgreSQL about a fifth less per job
(bench/README.md). One counter is one lock, so it cannot deadlock with groups
that lock several in key order. Where the counter did not move (the key's first
job, or not all of the group fits), the group goes through the statement above,
which places each row.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import JSON, Connection

from core.db.schema import Job

# The attributes a new job is inserted with (the others, output, timings, the batch, a
# backfill's, are left SQL NULL, as the ORM leaves them).
INSERTED = (
    "id",
    "api_key_id",
    "model",
    "requested_version",
    "priority",
    "status",
    "input",
    "cost",
    "attempts",
    "created_at",
    "deadline_at",
    "callback_url",
    "callback_events",
    "idempotency_key",
    "metadata_",
    "request_id",
    "trace_context",
)
_TABLE_COLUMNS = {prop.key: prop.columns[0] for prop in Job.__mapper__.column_attrs}
_ROW = {attr: _TABLE_COLUMNS[attr] for attr in INSERTED}
# Each inserted column's name (``metadata_`` is stored as ``metadata``); json_populate_recordset
# reads each as the table's own type.
COLUMNS: tuple[str, ...] = tuple(column.name for column in _ROW.values())
JSON_COLUMNS = frozenset(column.name for column in _ROW.values() if isinstance(column.type, JSON))


def row_of(job: Job) -> dict[str, Any]:
    """The job's inserted values by column name."""
    return {column.name: getattr(job, attr) for attr, column in _ROW.items()}


# No limit: more than any key's jobs.
UNLIMITED = 2**62


def _values(source: str) -> str:
    """The inserted columns' values, read from ``source``'s columns."""
    # A JSON null comes out of json_populate_recordset as SQL NULL; the ORM stores
    # Python's None in a JSON column as JSON null, and so does this.
    return ", ".join(
        f"COALESCE({source}.{name}, 'null'::json)" if name in JSON_COLUMNS else f"{source}.{name}"
        for name in COLUMNS
    )


def _statement() -> str:
    values = _values("ranked")
    return f"""
WITH r AS (
    SELECT r.*, r.ordinality AS ord
    FROM json_populate_recordset(NULL::jobs, %(rows)s::json) WITH ORDINALITY AS r
), counters AS (
    SELECT api_key_id, outstanding FROM key_usage
    WHERE api_key_id IN (SELECT api_key_id FROM r)
    ORDER BY api_key_id FOR UPDATE
), ranked AS (
    SELECT r.*, row_number() OVER (PARTITION BY r.api_key_id ORDER BY r.ord) AS rank FROM r
), inserted AS (
    INSERT INTO jobs ({", ".join(COLUMNS)})
    SELECT {values}
    FROM ranked JOIN counters ON counters.api_key_id = ranked.api_key_id
    WHERE ranked.rank <= %(limit)s - counters.outstanding
    ORDER BY ranked.ord
    ON CONFLICT (api_key_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, api_key_id
), counted AS (
    UPDATE key_usage SET outstanding = key_usage.outstanding + n.added
    FROM (SELECT api_key_id, count(*) AS added FROM inserted GROUP BY api_key_id) AS n
    WHERE key_usage.api_key_id = n.api_key_id
    RETURNING key_usage.api_key_id
)
SELECT 'job', id, NULL::bigint FROM inserted
UNION ALL
SELECT 'counter', api_key_id, outstanding FROM counters
"""


STATEMENT = _statement()
# One key's group, no idempotency key in it: the counter moves by the group's size if
# all of it fits, and then every row is inserted; else nothing is written.
ONE_KEY = f"""
WITH counted AS (
    UPDATE key_usage SET outstanding = outstanding + %(count)s
    WHERE api_key_id = %(key_id)s AND outstanding + %(count)s <= %(limit)s
    RETURNING api_key_id
), inserted AS (
    INSERT INTO jobs ({", ".join(COLUMNS)})
    SELECT {_values("r")}
    FROM json_populate_recordset(NULL::jobs, %(rows)s::json) AS r
    WHERE EXISTS (SELECT FROM counted)
)
SELECT count(*) FROM counted
"""
# A key's counter row, where it has none (a key's first job).
ADD_COUNTER = (
    "INSERT INTO key_usage (api_key_id, outstanding) VALUES (%(key_id)s, 0) "
    "ON CONFLICT (api_key_id) DO NOTHING"
)


def _encoded(value: Any) -> str:
    """What json.dumps cannot encode itself: a timestamp, as PostgreSQL reads one."""
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON: {value!r}")


@dataclass
class Written:
    """What one statement did with each candidate (by its position in the rows sent)."""

    inserted: list[int] = field(default_factory=list)
    conflicted: list[int] = field(default_factory=list)  # its idempotency key was taken
    over_quota: list[int] = field(default_factory=list)
    uncounted: list[int] = field(default_factory=list)  # its key has no counter row yet


def write(connection: Connection, rows: Sequence[dict[str, Any]], limit: int | None) -> Written:
    """Insert ``rows`` (each a dict of :data:`COLUMNS`, JSON values as Python objects) under
    each key's outstanding ``limit`` (None: none), on an autocommit ``connection``."""
    # Each value as the ORM's JSON type writes it (json.dumps' own separators), so the
    # stored text is the same whichever path wrote the row.
    document = json.dumps(rows, default=_encoded)
    bound = UNLIMITED if limit is None else limit
    key_ids = {row["api_key_id"] for row in rows}
    if len(key_ids) == 1 and all(row["idempotency_key"] is None for row in rows):
        parameters = {"rows": document, "limit": bound, "count": len(rows), "key_id": key_ids.pop()}
        if connection.exec_driver_sql(ONE_KEY, parameters).scalar_one():
            return Written(inserted=list(range(len(rows))))
    ids: set[str] = set()
    counters: dict[str, int] = {}
    for kind, name, count in connection.exec_driver_sql(
        STATEMENT, {"rows": document, "limit": bound}
    ):
        if kind == "job":
            ids.add(name)
        else:
            counters[name] = int(count)
    return classify(rows, ids, counters, bound)


def classify(
    rows: Sequence[dict[str, Any]], ids: set[str], counters: dict[str, int], limit: int
) -> Written:
    """Each row's fate, numbering a key's rows in order as the statement does."""
    written = Written()
    ranks: dict[str, int] = {}
    for at, row in enumerate(rows):
        key_id = row["api_key_id"]
        ranks[key_id] = rank = ranks.get(key_id, 0) + 1
        if row["id"] in ids:
            written.inserted.append(at)
        elif key_id not in counters:
            written.uncounted.append(at)
        elif rank > limit - counters[key_id]:
            written.over_quota.append(at)
        else:
            written.conflicted.append(at)
    return written


def add_counters(connection: Connection, key_ids: Sequence[str]) -> None:
    """Give each key a counter row (at 0) where it has none."""
    for key_id in sorted(set(key_ids)):
        connection.exec_driver_sql(ADD_COUNTER, {"key_id": key_id})
