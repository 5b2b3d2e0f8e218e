"""The API's reads on PostgreSQL from the event loop (api.jobs.reads.LoopReader): the same
resources as the engine's reads in threads (JobReader), and a connection the server closed
between reads costs no request an error."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, make_url, text

from api.errors import ApiError
from api.jobs.reads import JobRead, JobReader, LoopReader
from api.jobs.schemas import JobResource
from core.db.keys import create_key
from core.db.schema import Job, WebhookDelivery, make_engine, make_sessionmaker, read_only

T = TypeVar("T")


def _jobs(url: str) -> tuple[str, str, list[str]]:
    """Two keys; a queued job, a finished one with a callback and its delivery, a failed
    one; and another key's job. (key, other key, the first key's job ids)."""
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    now = dt.datetime(2026, 12, 7, 5, 30, 0, 123456, tzinfo=dt.UTC)
    ids = [str(uuid.uuid4()) for _ in range(4)]
    with sessions() as session:
        key = create_key(session, "reader").id
        other = create_key(session, "other").id
        common = {"model": "sim", "priority": "normal", "cost": 1, "created_at": now}
        session.add_all(
            [
                Job(id=ids[0], api_key_id=key, status="queued", input={"x": 1}, **common),
                Job(
                    id=ids[1],
                    api_key_id=key,
                    status="succeeded",
                    input={"x": 2},
                    output={"vector": [0.25, -1.5], "label": "é"},
                    attempts=1,
                    started_at=now + dt.timedelta(milliseconds=3),
                    finished_at=now + dt.timedelta(milliseconds=9),
                    batch_id="batch-1",
                    batch_size=2,
                    inference_ms=4.5,
                    callback_url="https://example.com/hook",
                    metadata_={"team": "search"},
                    **common,
                ),
                Job(
                    id=ids[2],
                    api_key_id=key,
                    status="failed",
                    input={"x": 3},
                    error="boom",
                    attempts=2,
                    finished_at=now,
                    **common,
                ),
                Job(id=ids[3], api_key_id=other, status="queued", input={"x": 4}, **common),
            ]
        )
        session.flush()
        session.add(
            WebhookDelivery(
                id="msg_1",
                api_key_id=key,
                job_id=ids[1],
                event_type="job.succeeded",
                url="https://example.com/hook",
                payload="{}",
                status="retrying",
                attempts=2,
                last_status_code=503,
                next_attempt_at=now + dt.timedelta(seconds=30),
            )
        )
        session.commit()
    engine.dispose()
    return key, other, ids


@pytest.fixture
def engine(postgres_database: str) -> Iterator[Engine]:
    engine = make_engine(postgres_database)
    yield engine
    engine.dispose()


def _dumped(answers: list[JobResource | Exception]) -> list[object]:
    out: list[object] = []
    for answer in answers:
        if isinstance(answer, ApiError):
            out.append((answer.status, answer.type))
        else:
            assert isinstance(answer, JobResource), answer
            out.append(answer.model_dump(mode="json"))
    return out


def in_loop(reader: LoopReader, work: Callable[[], Awaitable[T]]) -> T:
    """``work()`` on an event loop of its own, the reader closed after it."""

    async def run() -> T:
        try:
            return await work()
        finally:
            await reader.close()

    return asyncio.run(run())


def test_the_loop_reader_answers_as_the_engines_reads_do(
    postgres_database: str, engine: Engine
) -> None:
    key, _other, ids = _jobs(postgres_database)
    group = [JobRead(key, job_id) for job_id in [*ids, str(uuid.uuid4())]]
    threaded = JobReader(read_only(engine)).read(group)
    reader = LoopReader.of(engine)
    answers = in_loop(reader, lambda: reader.read(group))
    assert _dumped(answers) == _dumped(threaded)
    # What both said: the rows as stored, another key's job and a missing one as 404s.
    first, succeeded, failed, others, missing = _dumped(answers)
    assert isinstance(succeeded, dict) and isinstance(first, dict) and isinstance(failed, dict)
    assert succeeded["output"] == {"vector": [0.25, -1.5], "label": "é"}
    assert succeeded["created_at"] == "2026-12-07T05:30:00.123456Z"
    assert succeeded["timings"] == {"queue_ms": 3.0, "inference_ms": 4.5, "total_ms": 9.0}
    assert succeeded["callback"]["status"] == "retrying"
    assert succeeded["callback"]["next_attempt_at"] == "2026-12-07T05:30:30.123456Z"
    assert succeeded["metadata"] == {"team": "search"}
    assert (first["status"], failed["status"], failed["error"]) == ("queued", "failed", "boom")
    assert others == missing == (404, "not_found")


def test_a_connection_the_server_closed_between_reads_is_replaced_unseen(
    postgres_database: str, engine: Engine
) -> None:
    key, _other, ids = _jobs(postgres_database)
    reader = LoopReader.of(engine)
    backends: list[int] = []

    async def reads() -> list[list[JobResource | Exception]]:
        answers = [await reader.read([JobRead(key, ids[1])])]
        (kept,) = reader._idle
        backends.append(kept[0].info.backend_pid)
        # The server ends the kept connection (as a restart or a failover would).
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": backends[0]})
        answers.append(await reader.read([JobRead(key, ids[1])]))
        (kept,) = reader._idle
        backends.append(kept[0].info.backend_pid)
        return answers

    before, after = in_loop(reader, reads)
    assert _dumped(after) == _dumped(before)
    assert isinstance(after[0], JobResource) and after[0].status == "succeeded"
    assert backends[0] != backends[1]
    assert reader._idle == []  # closed with the reader


def test_an_unreachable_database_is_a_503_and_the_next_read_recovers(
    postgres_database: str, engine: Engine
) -> None:
    key, _other, ids = _jobs(postgres_database)
    reader = LoopReader.of(engine)
    reachable = reader.connect
    # Nothing listens on port 1: the connection is refused at once.
    reader.connect = reachable | {"port": "1"}

    async def reads() -> tuple[list[JobResource | Exception], list[JobResource | Exception]]:
        refused = await reader.read([JobRead(key, ids[0]), JobRead(key, ids[1])])
        reader.connect = reachable
        return refused, await reader.read([JobRead(key, ids[0])])

    refused, answered = in_loop(reader, reads)
    assert [(a.status, a.type) for a in refused if isinstance(a, ApiError)] == [
        (503, "unavailable")
    ] * 2
    assert isinstance(answered[0], JobResource) and answered[0].status == "queued"


def test_a_read_cancelled_midway_closes_its_connection(
    postgres_database: str, engine: Engine
) -> None:
    """The API stopping cancels a read in flight: its connection, in an unknown state, is
    closed, not kept for the next read."""
    key, _other, ids = _jobs(postgres_database)
    reader = LoopReader.of(engine)
    opened: list[Any] = []

    async def cancelled() -> None:
        await reader.read([JobRead(key, ids[0])])  # a connection, kept
        (kept,) = reader._idle
        opened.append(kept[0])
        with engine.connect() as locker:
            # The table locked: the next read waits in PostgreSQL until it is cancelled.
            locker.execute(text("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"))
            read = asyncio.create_task(reader.read([JobRead(key, ids[0])]))
            await asyncio.sleep(0.3)
            assert not read.done()
            read.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await read
            locker.rollback()
        await reader.close()

    asyncio.run(cancelled())
    assert reader._idle == []
    assert opened[0].closed


def test_a_url_naming_several_hosts_reaches_the_one_that_answers(postgres_database: str) -> None:
    """A failover URL (one ``host`` parameter a server, tried in order) connects the reader
    as it connects the engine: past a host that refuses, to the one that answers."""
    key, _other, ids = _jobs(postgres_database)
    plain = make_url(postgres_database)
    failover = plain.set(host=None, port=None).update_query_pairs(
        [("host", "127.0.0.1:1"), ("host", f"{plain.host}:{plain.port or 5432}")]
    )
    engine = make_engine(failover.render_as_string(hide_password=False))
    reader = LoopReader.of(engine)
    try:
        (answer,) = in_loop(reader, lambda: reader.read([JobRead(key, ids[0])]))
    finally:
        engine.dispose()
    assert isinstance(answer, JobResource) and answer.status == "queued", answer
