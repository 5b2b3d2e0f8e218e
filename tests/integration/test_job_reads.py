"""The group read on PostgreSQL, each row as one JSON object (api.jobs.reads), answers what
the Core statement's rows answer: every field of every kind of job, to the microsecond."""

from __future__ import annotations

import datetime as dt
from typing import Any, cast

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from api.jobs.reads import _JOB, JobRead, JobReader
from api.jobs.schemas import JobResource
from core.db.keys import create_key
from core.db.resources import job_resource
from core.db.schema import Job, make_engine, read_only

pytestmark = pytest.mark.one_database("postgresql")


def test_json_rows_read_as_the_core_statements_rows(
    database_url: str, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        key = create_key(session, "reads").id
    engine = make_engine(database_url)
    at = dt.datetime(2026, 12, 6, 23, 59, 58, 123456, tzinfo=dt.UTC)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (id, api_key_id, model, priority, status, input, output, "
                "error, cost, attempts, created_at, started_at, finished_at, deadline_at, "
                "batch_id, batch_size, inference_ms, metadata, model_version, callback_url, "
                "callback_events, idempotency_key, request_id, trace_context) VALUES "
                "('a', :key, 'sim', 'vip', 'succeeded', '{\"cost\": 3}', "
                '\'{"vector": [0.5, -1e-7, 3.25], "text": "é \\\\u0000?"}\', NULL, 3, 1, '
                ":at, :at, :at, :at, 'b1', 7, 12.5, '{\"team\": [1, null, true]}', 2, "
                "'https://example.com/h', 'terminal', 'idem', 'req-1', NULL), "
                "('b', :key, 'lm', 'normal', 'running', "
                '\'{"prompt_tokens": 12, "max_tokens": 40, "prompt": "hi"}\', NULL, NULL, '
                "52, 2, :at, :at, NULL, NULL, NULL, NULL, NULL, 'null', NULL, NULL, NULL, NULL, "
                "NULL, NULL), "
                "('c', :key, 'sim', 'urgent', 'failed', '[1, 2]', 'null', 'boom: ''quoted''', "
                "1, 3, :at, :at, :at, NULL, 'b2', 1, 0.0, NULL, 1, NULL, NULL, NULL, NULL, "
                "'00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01')"
            ),
            {"key": key, "at": at},
        )
    reads = read_only(engine)
    reader = JobReader(reads)
    try:
        ids = ["a", "b", "c"]
        got = reader.read([JobRead(key, job_id) for job_id in ids])
        with reads.connect() as conn:
            rows = {row.id: row for row in conn.execute(_JOB, {"ids": ids})}
        for job_id, resource in zip(ids, got, strict=True):
            assert isinstance(resource, JobResource), resource
            row: Any = rows[job_id]
            expected = JobResource.model_validate(job_resource(cast(Job, row), None))
            assert resource.model_dump() == expected.model_dump(), job_id
            assert resource.created_at == at
    finally:
        reader.close()
        engine.dispose()
