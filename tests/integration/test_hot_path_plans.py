"""The worker's statements on the jobs table find their rows by primary key, whatever plan
PostgreSQL caches for them.

The driver prepares a statement it sends often, and PostgreSQL may then run it on a
generic plan, chosen without the parameters' values: it guesses ten rows for an
``unnest`` of an array parameter and a default share for a filter on one. On an analyzed
table of 1,500 jobs that guess once made a batch's outcomes (``UPDATE ... FROM
unnest(...)``) a nested loop over every row of the table, eighteen times the cost of
finding them by key, growing with the table. Here each statement the recorder sends for
one batch (the claim, which leaves out jobs started before, the outcomes, what follows a
terminal write) is planned generically on real PostgreSQL and must reach ``jobs``
through its primary key. And a plain job's row is in three of the table's indexes (each
of its writes enters it in each), the unique ones holding only the rows they constrain.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from api.jobs.reads import _PG_JOB
from core.db.keys import create_key
from core.db.schema import make_engine, make_sessionmaker
from harness.services import migrated_postgres_database
from workers.gpu.recorder import Outcome, Recorder

# Enough jobs that a plan visiting every row costs more than one finding 32 by key.
TABLE_JOBS = 1500
BATCH = 32


class Sent:
    """Every statement an engine sends, with its parameters."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if isinstance(parameters, dict):
            with self.lock:
                self.statements.append((statement, dict(parameters)))


@pytest.fixture
def analyzed_jobs() -> Iterator[tuple[Engine, list[str]]]:
    """A PostgreSQL database holding TABLE_JOBS queued jobs, analyzed (as autovacuum
    leaves a table that has grown)."""
    with migrated_postgres_database() as url:
        engine = make_engine(url)
        with make_sessionmaker(engine)() as session:
            create_key(session, "plans")
        with engine.begin() as conn:
            key = conn.execute(text("SELECT id FROM api_keys")).scalar_one()
            conn.execute(
                text(
                    "INSERT INTO jobs (id, api_key_id, model, priority, status, input, cost, "
                    "attempts, created_at) SELECT 'job-' || n, :key, 'sim', 'normal', 'queued', "
                    "'{}'::json, 1, 0, now() FROM generate_series(1, :n) AS n"
                ),
                {"key": key, "n": TABLE_JOBS},
            )
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE jobs"))
        try:
            yield engine, [f"job-{n}" for n in range(1, TABLE_JOBS + 1)]
        finally:
            engine.dispose()


def generic_plan(engine: Engine, statement: str, parameters: dict[str, Any]) -> str:
    """The plan PostgreSQL caches for ``statement`` once it is prepared and planned
    without its parameters' values (``plan_cache_mode = force_generic_plan``)."""
    names: list[str] = []

    def number(found: re.Match[str]) -> str:
        if found.group(1) not in names:
            names.append(found.group(1))
        return f"${names.index(found.group(1)) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", number, statement)
    arguments = ", ".join(f"%({name})s" for name in names)
    with engine.connect() as conn:
        conn.exec_driver_sql("DEALLOCATE ALL")  # a pooled connection's earlier one
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE planned AS {prepared}")
        # The values as literals (EXECUTE's own arguments would need their types).
        raw = conn.connection.driver_connection
        assert isinstance(raw, psycopg.Connection)
        with psycopg.ClientCursor(raw) as cursor:
            cursor.execute(
                f"EXPLAIN EXECUTE planned({arguments})", {n: parameters[n] for n in names}
            )
            plan = "\n".join(row[0] for row in cursor.fetchall())
        conn.rollback()
    return plan


def test_every_statement_of_a_batch_reaches_jobs_by_primary_key(
    analyzed_jobs: tuple[Engine, list[str]],
) -> None:
    engine, ids = analyzed_jobs
    batch = ids[:BATCH]
    recorder = Recorder(make_sessionmaker(engine))
    sent = Sent()
    event.listen(engine, "before_cursor_execute", sent)
    try:
        now = dt.datetime.now(dt.UTC)
        claimed, late, exhausted, held = recorder.claim(
            batch, now, max_attempts=3, hold_started=True
        )
        written = recorder.finish(
            [Outcome(c.job_id, "succeeded", output=[0.5], inference_ms=1.0) for c in claimed],
            now,
            batch_id="batch-1",
            batch_size=len(claimed),
        )
        # The claim (one UPDATE returning the jobs it started) and the outcomes (which
        # return what follows a terminal write): a batch whose jobs all start sends no more.
        assert (len(claimed), late, exhausted, held) == (BATCH, [], [], [])
        assert sorted(written) == sorted(batch)
        assert len([s for s, _ in sent.statements if re.search(r"\bjobs\b", s)]) == 2
        # A batch with a job started before (held) reads why the others did not start.
        recorder.claim(ids[BATCH : BATCH + 1], now, max_attempts=3)
        again = recorder.claim(ids[BATCH : 2 * BATCH], now, max_attempts=3, hold_started=True)
        assert (len(again.claimed), again.held) == (BATCH - 1, [ids[BATCH]])
    finally:
        event.remove(engine, "before_cursor_execute", sent)

    on_jobs = [(s, p) for s, p in sent.statements if re.search(r"\bjobs\b", s)]
    assert len(on_jobs) == 5, [s for s, _ in sent.statements]
    for statement, parameters in on_jobs:
        plan = generic_plan(engine, statement, parameters)
        values = json.dumps(parameters, default=str)[:300]
        why = f"{' '.join(statement.split())}\n{plan}\nparameters: {values}"
        assert "Seq Scan on jobs" not in plan, why
        assert "jobs_pkey" in plan, why


def test_a_plain_job_is_in_three_of_the_jobs_indexes(
    analyzed_jobs: tuple[Engine, list[str]],
) -> None:
    """Every update that changes the status enters the row in each index anew, so each
    index a plain job (no idempotency key, no backfill) is in costs it three entries.
    The unique indexes hold only the rows they constrain, which are still unique."""
    engine, ids = analyzed_jobs
    with engine.begin() as conn:
        key = conn.execute(text("SELECT id FROM api_keys")).scalar_one()
        conn.execute(
            text(
                "INSERT INTO jobs (id, api_key_id, model, priority, status, input, cost, "
                "attempts, created_at, idempotency_key, backfill_id, line_no, custom_id) "
                "SELECT 'special-' || n, :key, 'sim', 'normal', 'queued', '{}'::json, 1, 0, "
                "now(), CASE WHEN n <= 20 THEN 'idem-' || n END, "
                "CASE WHEN n > 20 THEN 'backfill-1' END, CASE WHEN n > 20 THEN n END, "
                "CASE WHEN n > 40 THEN 'custom-' || n END FROM generate_series(1, 60) AS n"
            ),
            {"key": key},
        )
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text("VACUUM ANALYZE jobs"))  # an index's reltuples: its entries now
        held: dict[str, int] = dict(
            conn.execute(
                text(
                    "SELECT c.relname, c.reltuples::int FROM pg_index i "
                    "JOIN pg_class c ON c.oid = i.indexrelid "
                    "WHERE i.indrelid = 'jobs'::regclass"
                )
            ).all()
        )
    every = len(ids) + 60
    assert sorted(name for name, rows in held.items() if rows == every) == [
        "ix_jobs_key_created",
        "ix_jobs_status_finished",
        "jobs_pkey",
    ], held
    assert held["ux_jobs_key_idempotency"] == 20, held
    assert held["ux_jobs_backfill_line"] == 40, held
    assert held["ux_jobs_backfill_custom_id"] == 40, held  # custom_id NULL: held, never clashes

    with engine.begin() as conn:
        again = conn.execute(
            text(
                "INSERT INTO jobs (id, api_key_id, model, priority, status, input, cost, "
                "attempts, created_at, idempotency_key) VALUES ('again', :key, 'sim', "
                "'normal', 'queued', '{}'::json, 1, 0, now(), 'idem-3') "
                "ON CONFLICT (api_key_id, idempotency_key) WHERE idempotency_key IS NOT NULL "
                "DO NOTHING RETURNING id"
            ),
            {"key": key},
        ).all()
    assert again == []
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (id, api_key_id, model, priority, status, input, cost, "
                "attempts, created_at, backfill_id, line_no) VALUES ('clash', :key, 'sim', "
                "'normal', 'queued', '{}'::json, 1, 0, now(), 'backfill-1', 30)"
            ),
            {"key": key},
        )

    # A backfill's reads name it with =, which is never true of a NULL: they use its index.
    for statement in (
        "SELECT id FROM jobs WHERE backfill_id = %(backfill)s LIMIT 1000",
        "SELECT line_no, status FROM jobs WHERE backfill_id = %(backfill)s "
        "AND line_no > %(after)s ORDER BY line_no LIMIT 500",
    ):
        plan = generic_plan(engine, statement, {"backfill": "backfill-1", "after": 0})
        assert "Seq Scan on jobs" not in plan, plan
        assert "ux_jobs_backfill" in plan, plan


def test_the_apis_read_of_a_group_of_jobs_reaches_them_by_primary_key(
    analyzed_jobs: tuple[Engine, list[str]],
) -> None:
    """A long-poll's read (api.jobs.reads.LoopReader): one statement, its ids one array,
    prepared once for every group size, must find them by key on its generic plan."""
    engine, ids = analyzed_jobs
    for group in (ids[:1], ids[:BATCH]):
        plan = generic_plan(engine, _PG_JOB.sql, _PG_JOB.params | {"ids": group})
        assert "Seq Scan on jobs" not in plan, plan
        assert "jobs_pkey" in plan, plan
