"""The group commit's one statement on PostgreSQL (api.jobs.at_once): the quota exact
across writers that share no process state, a key's first job, idempotency keys taken
meanwhile, and rows stored as the ORM's insert stores them. Real PostgreSQL and Redis;
the writers are the API's own (``GroupWriter``), each with its own engine, as separate
API processes would have."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis
from sqlalchemy import event, select, text
from sqlalchemy.orm import Session, sessionmaker

from api.errors import ApiError
from api.jobs import at_once
from api.jobs.at_once import Written, classify
from api.jobs.schemas import JobCreate
from api.jobs.submissions import GroupWriter, Submission, Submitted, prepare
from api.models.service import resolve_model
from backends.catalog import build_catalog
from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import ApiKey, Job, KeyUsage, make_engine, make_sessionmaker

pytestmark = pytest.mark.one_database("postgresql")


def writer(settings: Settings, limit: int | None) -> GroupWriter:
    sessions = make_sessionmaker(make_engine(settings.sqlalchemy_url))
    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    return GroupWriter(
        sessions, client, settings.key_prefix, max_outstanding=limit, requeue_within_s=90
    )


def keys(sessions: sessionmaker[Session], *names: str) -> list[ApiKey]:
    found = []
    with sessions() as session:
        for name in names:
            key_id = create_key(session, name).id
            key = session.get(ApiKey, key_id)
            assert key is not None
            session.expunge(key)
            found.append(key)
    return found


def submission(
    settings: Settings, key: ApiKey, idempotency_key: str | None = None, cost: int = 1, **body: Any
) -> Submission:
    return prepare(
        build_catalog(settings),
        key,
        JobCreate(model="sim", input={"cost": cost}, **body),
        idempotency_key,
        None,
        max_metadata_bytes=1024,
        max_json_depth=16,
        live=None,
        resolve=resolve_model,
    )


def test_writers_of_many_processes_hold_each_keys_quota_exactly(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Four writers, each with its own pool, write groups of both keys at once; neither key
    has a counter row before (their first jobs race to make it)."""
    first, second = keys(sessions, "first", "second")
    writers = [writer(settings, limit=30) for _ in range(4)]
    outcomes: list[Any] = []
    lock = threading.Lock()
    start = threading.Barrier(len(writers))

    def run(w: GroupWriter) -> None:
        start.wait()
        for _ in range(6):
            group = [submission(settings, k) for k in (first, second, first, second, first)]
            found = w.write(group)
            with lock:
                outcomes.extend(zip(group, found, strict=True))

    threads = [threading.Thread(target=run, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(outcomes) == 4 * 6 * 5
    for key, asked in ((first, 72), (second, 48)):
        mine = [found for item, found in outcomes if item.key.id == key.id]
        assert len(mine) == asked
        accepted = [found for found in mine if isinstance(found, Submitted)]
        refused = [found for found in mine if isinstance(found, ApiError)]
        assert len(accepted) == 30, [getattr(r, "message", r) for r in refused[:3]]
        assert {r.type for r in refused} == {"quota_exceeded"}
        with sessions() as session:
            stored = session.scalars(select(Job.id).where(Job.api_key_id == key.id)).all()
            counter = session.get(KeyUsage, key.id)
        assert sorted(stored) == sorted(found.job.id for found in accepted)
        assert counter is not None and counter.outstanding == 30


def test_one_keys_groups_from_many_writers_hold_its_quota_exactly(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Groups of one key's jobs only (each tried as ONE_KEY first), four writers at once,
    up to the quota and past it: the key's counter and its rows end at the limit, and every
    request is answered as what happened to its row."""
    (key,) = keys(sessions, "one key")
    writers = [writer(settings, limit=40) for _ in range(4)]
    writers[0].write([submission(settings, key)])  # the counter made: ONE_KEY from here
    outcomes: list[Any] = []
    lock = threading.Lock()
    start = threading.Barrier(len(writers))

    def run(w: GroupWriter) -> None:
        start.wait()
        for size in (3, 1, 4, 2, 5):
            found = w.write([submission(settings, key) for _ in range(size)])
            with lock:
                outcomes.extend(found)

    threads = [threading.Thread(target=run, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(outcomes) == 4 * 15
    accepted = [found for found in outcomes if isinstance(found, Submitted)]
    refused = [found for found in outcomes if isinstance(found, ApiError)]
    assert len(accepted) == 39
    assert {r.type for r in refused} == {"quota_exceeded"}
    with sessions() as session:
        stored = session.scalars(select(Job.id).where(Job.api_key_id == key.id)).all()
        counter = session.get(KeyUsage, key.id)
    assert len(stored) == 40
    assert {found.job.id for found in accepted} <= set(stored)
    assert counter is not None and counter.outstanding == 40


def test_groups_waiting_on_a_key_see_the_count_the_one_before_left(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Two groups of two, with two places left, arrive while another transaction holds
    the key's counter: each must count from what the one before it left, not from what
    its statement's snapshot saw."""
    (key,) = keys(sessions, "waiting")
    writers = [writer(settings, limit=5) for _ in range(2)]
    for _ in range(3):
        writers[0].write([submission(settings, key)])
    holder = make_engine(settings.sqlalchemy_url)
    found: list[Any] = []
    with holder.connect() as conn:
        conn.execute(
            text("SELECT outstanding FROM key_usage WHERE api_key_id = :k FOR UPDATE"),
            {"k": key.id},
        )
        threads = [
            threading.Thread(
                target=lambda w=w: found.extend(
                    w.write([submission(settings, key), submission(settings, key)])
                )
            )
            for w in writers
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # both statements are in, waiting on the counter
        assert found == []
        conn.commit()
    for thread in threads:
        thread.join(timeout=30)
    holder.dispose()
    assert sorted(type(f).__name__ for f in found) == ["ApiError"] * 2 + ["Submitted"] * 2
    with sessions() as session:
        counter = session.get(KeyUsage, key.id)
        jobs = session.scalars(select(Job.id).where(Job.api_key_id == key.id)).all()
    assert counter is not None and counter.outstanding == 5
    assert len(jobs) == 5


def test_a_taken_idempotency_key_is_answered_and_leaves_its_room_to_the_next(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    (key,) = keys(sessions, "room")
    w = writer(settings, limit=3)
    (earlier,) = w.write([submission(settings, key, "kept")])
    assert isinstance(earlier, Submitted) and not earlier.replayed
    w.write([submission(settings, key)])
    # One place left. The replay comes first in its group: it must not take the place.
    replay, fresh, over = w.write(
        [submission(settings, key, "kept"), submission(settings, key), submission(settings, key)]
    )
    assert isinstance(replay, Submitted) and replay.replayed
    assert replay.job.id == earlier.job.id
    assert isinstance(fresh, Submitted) and not fresh.replayed
    assert isinstance(over, ApiError) and over.type == "quota_exceeded"
    # At the quota, a replay is still answered; a different request with the key is not.
    (again,) = w.write([submission(settings, key, "kept")])
    assert isinstance(again, Submitted) and again.replayed
    (conflict,) = w.write([submission(settings, key, "kept", cost=2)])
    assert isinstance(conflict, ApiError) and conflict.status == 409
    with sessions() as session:
        counter = session.get(KeyUsage, key.id)
        assert counter is not None and counter.outstanding == 3


def test_rows_written_at_once_are_stored_as_the_orm_stores_them(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    (key,) = keys(sessions, "rows")
    w = writer(settings, limit=None)
    w.write([submission(settings, key)])  # the key's counter made
    # Alone, a plain job is written by ONE_KEY; beside one with an idempotency key, by
    # the statement that places each row.
    (alone,) = w.write([submission(settings, key)])
    plain, full = w.write(
        [
            submission(settings, key),
            submission(
                settings,
                key,
                "idem-1",
                priority="vip",
                deadline_ms=60_000,
                metadata={"team": "ranking", "n": [1, 2.5, None]},
                callback_url="https://example.com/hook",
            ),
        ]
    )
    assert isinstance(plain, Submitted) and isinstance(full, Submitted)
    assert isinstance(alone, Submitted)
    with sessions() as session:
        for sent in (alone.job, plain.job, full.job):
            row = session.get(Job, sent.id)
            assert row is not None
            for column in (
                "api_key_id", "model", "priority", "status", "input", "cost", "attempts",
                "created_at", "deadline_at", "callback_url", "idempotency_key", "metadata_",
            ):  # fmt: skip
                assert getattr(row, column) == getattr(sent, column), column
        # JSON as the ORM writes it: an absent metadata is JSON null, as before.
        stored = [
            session.execute(
                text("SELECT metadata::text, input::text FROM jobs WHERE id = :id"),
                {"id": sent.id},
            ).one()
            for sent in (alone.job, plain.job)
        ]
    assert stored == [("null", '{"cost": 1}')] * 2


def test_one_keys_group_is_one_statement_where_it_fits_whole_else_placed_row_by_row(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """ONE_KEY writes a group of one key's jobs with no idempotency key where all of it
    fits; the key's first job, a group that fits only in part, and a group holding an
    idempotency key go through the statement that places each row, and what fits of them
    still goes in."""
    lean, other = keys(sessions, "lean", "other")
    w = writer(settings, limit=4)
    engine = w.sessions.kw["bind"]
    sent: list[str] = []
    named = {at_once.ONE_KEY: "one key", at_once.STATEMENT: "each row"}
    named[at_once.ADD_COUNTER] = "counter"

    def record(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if statement in named:
            sent.append(named[statement])

    event.listen(engine, "before_cursor_execute", record)

    def write(*group: Submission) -> tuple[list[str], list[str]]:
        sent.clear()
        found = w.write(list(group))
        return list(sent), [type(f).__name__ for f in found]

    # The key's first job: no counter row for ONE_KEY to move.
    assert write(submission(settings, lean)) == (
        ["one key", "each row", "counter", "one key"],
        ["Submitted"],
    )
    assert write(submission(settings, lean), submission(settings, lean)) == (
        ["one key"],
        ["Submitted", "Submitted"],
    )
    # One place left of the limit's four: the first of three fits.
    assert write(*(submission(settings, lean) for _ in range(3))) == (
        ["one key", "each row"],
        ["Submitted", "ApiError", "ApiError"],
    )
    assert write(submission(settings, other), submission(settings, other, "idem"))[0] == [
        "each row",
        "counter",
        "each row",
    ]
    assert write(submission(settings, lean), submission(settings, other))[0] == ["each row"]
    with sessions() as session:
        counter = session.get(KeyUsage, lean.id)
        stored = session.scalars(select(Job.id).where(Job.api_key_id == lean.id)).all()
    assert counter is not None and counter.outstanding == 4
    assert len(stored) == 4


@pytest.mark.parametrize(
    ("ids", "counters", "limit", "expected"),
    [
        # a: in; b: its key's place taken by no one, refused; c: its key has no counter
        ({"a"}, {"k": 1}, 2, Written(inserted=[0], over_quota=[1], uncounted=[2])),
        # the first of k not inserted though it fit: its idempotency key was taken
        (set(), {"k": 0}, 1, Written(conflicted=[0], over_quota=[1], uncounted=[2])),
    ],
)
def test_each_row_is_told_what_the_statement_did(
    ids: set[str], counters: dict[str, int], limit: int, expected: Written
) -> None:
    rows = [
        {"id": "a", "api_key_id": "k"},
        {"id": "b", "api_key_id": "k"},
        {"id": "c", "api_key_id": "new"},
    ]
    assert classify(rows, ids, counters, limit) == expected


def test_json_values_holding_any_character_are_stored_as_sent(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """A JSON column's value is stored as json.dumps wrote it, whatever it holds: a
    non-ASCII letter, a quote, a backslash, a line separator. (A NUL is refused before:
    PostgreSQL's text cannot hold one.)"""
    (key,) = keys(sessions, "characters")
    metadata = {"note": 'ab é "q" \\ \u2028', "n": [1, 2.5, None]}
    (sent,) = writer(settings, limit=None).write([submission(settings, key, metadata=metadata)])
    assert isinstance(sent, Submitted), sent
    with sessions() as session:
        row = session.get(Job, sent.job.id)
        assert row is not None and row.metadata_ == metadata
        stored = session.execute(
            text("SELECT metadata::text FROM jobs WHERE id = :id"), {"id": sent.job.id}
        ).scalar_one()
    assert stored == json.dumps(metadata)
