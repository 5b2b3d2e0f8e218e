"""The per-job path: submissions written in groups, keys cached, long-polls woken, not polling.

The API runs in uvicorn on a real port and is driven by many concurrent
HTTP clients, against the real database (SQLite and PostgreSQL) and Redis.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from api.groups import GroupStage
from api.jobs.schemas import JobCreate
from api.jobs.submissions import GroupCommit, GroupWriter, Submission, prepare
from api.models.service import resolve_model
from backends.catalog import build_catalog
from core.config.settings import Settings
from core.db.keys import create_key, revoke_key
from core.db.schema import ApiKey, Job, KeyUsage, make_engine, make_sessionmaker, utcnow
from core.streams.protocol import done_channel, stream_key
from harness import webclient
from harness.served import Served, served
from harness.services import started_redis


def post_all(
    base: str,
    bodies: list[dict[str, Any]],
    headers: list[dict[str, str]],
    check: Callable[..., Any],
) -> list[httpx.Response]:
    """POST every body at once (one connection each); ``check`` runs on each response as it
    arrives, before the next is awaited."""

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

            async def one(body: dict[str, Any], head: dict[str, str]) -> httpx.Response:
                response = await client.post("/v1/jobs", json=body, headers=head)
                await asyncio.to_thread(check, response)
                return response

            return list(
                await asyncio.gather(*(one(b, h) for b, h in zip(bodies, headers, strict=True)))
            )

    return asyncio.run(run())


def test_200_concurrent_submissions_are_committed_in_groups_before_each_202(
    settings: Settings, sessions: sessionmaker[Session], token: str, key_prefix: str
) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    committed_before_answer: list[bool] = []

    def committed(response: httpx.Response) -> None:
        # Read from another connection the moment the 202 arrives: the row is there.
        with sessions() as session:
            committed_before_answer.append(session.get(Job, response.json()["id"]) is not None)

    bodies: list[dict[str, Any]] = [
        {"model": "sim", "input": {"cost": 1 + i % 5}} for i in range(200)
    ]
    with served(settings) as api:
        responses = post_all(api.base, bodies, [auth] * 200, committed)
        inserts = api.count("INSERT INTO JOBS")
    assert [r.status_code for r in responses] == [202] * 200, responses[0].text
    ids = [r.json()["id"] for r in responses]
    assert len(set(ids)) == 200
    assert all(committed_before_answer) and len(committed_before_answer) == 200
    # Shared writes: far fewer INSERT statements than jobs.
    assert inserts < 100, inserts
    with sessions() as session:
        rows = session.scalars(select(Job).where(Job.id.in_(ids))).all()
        assert sorted(row.input["cost"] for row in rows) == sorted(
            b["input"]["cost"] for b in bodies
        )
        key_id = rows[0].api_key_id
        assert session.get(KeyUsage, key_id).outstanding == 200  # type: ignore[union-attr]
    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    entries: Any = client.xrange(stream_key(key_prefix, "sim", "normal", key_id))
    assert sorted(fields["job"] for _, fields in entries) == sorted(ids)  # each enqueued once


def test_idempotency_keys_hold_exactly_under_200_concurrent_submissions(
    settings: Settings, sessions: sessionmaker[Session], token: str
) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    bodies: list[dict[str, Any]] = [
        {"model": "sim", "input": {"cost": 2}, "idempotency_key": f"same-{i % 20}"}
        for i in range(200)
    ]
    with served(settings) as api:
        responses = post_all(api.base, bodies, [auth] * 200, lambda _r: None)
        conflict = webclient.post(
            f"{api.base}/v1/jobs",
            json={"model": "sim", "input": {"cost": 3}, "idempotency_key": "same-0"},
            headers=auth,
        )
    assert [r.status_code for r in responses] == [202] * 200
    by_key: dict[str, set[str]] = {}
    for body, response in zip(bodies, responses, strict=True):
        by_key.setdefault(body["idempotency_key"], set()).add(response.json()["id"])
    assert all(len(ids) == 1 for ids in by_key.values()) and len(by_key) == 20
    assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in responses) == 180
    assert conflict.status_code == 409 and conflict.json()["error"]["type"] == "conflict"
    with sessions() as session:
        stored = session.scalars(select(Job.idempotency_key)).all()
        assert sorted(str(s) for s in stored) == sorted(by_key)
        assert session.scalars(select(KeyUsage.outstanding)).all() == [20]


def test_the_outstanding_quota_holds_exactly_under_200_concurrent_submissions(
    settings: Settings, sessions: sessionmaker[Session], token: str
) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    bodies = [{"model": "sim", "input": {"cost": 1}} for _ in range(200)]
    with served(settings, max_outstanding_jobs=50) as api:
        responses = post_all(api.base, bodies, [auth] * 200, lambda _r: None)
        accepted = [r.json()["id"] for r in responses if r.status_code == 202]
        refused = [r for r in responses if r.status_code != 202]
        assert len(accepted) == 50
        assert len(refused) == 150
        assert {r.json()["error"]["type"] for r in refused} == {"quota_exceeded"}
        # Cancelling gives room back, exactly as much as was cancelled.
        for job_id in accepted[:10]:
            assert webclient.delete(f"{api.base}/v1/jobs/{job_id}", headers=auth).status_code == 200
        more = post_all(api.base, bodies[:11], [auth] * 11, lambda _r: None)
    assert sorted(r.status_code for r in more) == [202] * 10 + [429]
    with sessions() as session:
        (usage,) = session.scalars(select(KeyUsage)).all()
        assert usage.outstanding == 50
        queued = session.scalars(select(Job.id).where(Job.status == "queued")).all()
        assert len(queued) == 50


def test_a_database_error_fails_only_its_own_group_each_with_a_503(
    settings: Settings, sessions: sessionmaker[Session], token: str
) -> None:
    catalog = build_catalog(settings)
    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    with sessions() as session:
        key = session.scalars(select(ApiKey)).one()  # the ``token`` fixture's
        session.expunge(key)
    # A database that cannot be reached: SQLite in a folder that does not exist.
    down = make_sessionmaker(make_engine("sqlite:////nonexistent-folder/ferry.db"))
    writers = [
        GroupWriter(down, client, settings.key_prefix, max_outstanding=None, requeue_within_s=90),
        GroupWriter(
            sessions, client, settings.key_prefix, max_outstanding=None, requeue_within_s=90
        ),
    ]
    groups: list[int] = []

    def write(group: Any) -> Any:
        groups.append(len(group))
        return writers[min(len(groups) - 1, 1)].write(group)

    def submission(cost: int) -> Submission:
        body = JobCreate(model="sim", input={"cost": cost})
        return prepare(
            catalog, key, body, None, None, max_metadata_bytes=1024, max_json_depth=16,
            live=None, resolve=resolve_model,
        )  # fmt: skip

    async def run() -> tuple[list[Any], list[Any]]:
        stage: GroupCommit = GroupStage("test-commit", write, max_items=64, wait_s=0.05)
        stage.start()
        try:
            first = await asyncio.gather(
                *(stage.submit(submission(i + 1)) for i in range(5)), return_exceptions=True
            )
            second = await asyncio.gather(
                *(stage.submit(submission(i + 1)) for i in range(5)), return_exceptions=True
            )
        finally:
            await stage.stop()
        return first, second

    first, second = asyncio.run(run())
    assert groups == [5, 5]
    assert all(getattr(e, "status", None) == 503 for e in first), first
    assert all("the database is unavailable" in str(getattr(e, "message", "")) for e in first)
    assert [type(s).__name__ for s in second] == ["Submitted"] * 5
    with sessions() as session:
        stored = session.scalars(select(Job.id)).all()
    assert sorted(stored) == sorted(s.job.id for s in second)


def test_a_revoked_key_is_refused_within_the_key_cache_time(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        created = create_key(session, "soon revoked")
    auth = {"Authorization": f"Bearer {created.token}"}
    with served(settings, key_cache_s=1.0) as api:
        # The key is cached while this request is answered: not before this moment.
        cached_after = time.monotonic()
        assert webclient.get(f"{api.base}/v1/jobs", headers=auth).status_code == 200
        with sessions() as session:  # revoked by another process: the database, directly
            revoke_key(session, created.id)
        revoked_at = time.monotonic()
        lookups_before = api.count("SELECT API_KEYS")
        # Kept by this process for now (no lookup), then refused once the cache time is over.
        assert webclient.get(f"{api.base}/v1/jobs", headers=auth).status_code == 200
        while (status := webclient.get(f"{api.base}/v1/jobs", headers=auth).status_code) == 200:
            # Generous: only a key never looked up again gets there, however slow the machine.
            assert time.monotonic() - revoked_at < 30, "still accepted past FERRY_KEY_CACHE_S"
            time.sleep(0.05)
        refused_at = time.monotonic()
        assert status == 401
        assert api.count("SELECT API_KEYS") > lookups_before
    # Not looked up on every request: refused only after the cached entry's second.
    assert refused_at - cached_after >= 1.0


def _finish(sessions: sessionmaker[Session], job_id: str) -> None:
    """What a worker's terminal write does to the row (the publish is the test's)."""
    with sessions() as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status="succeeded", output={"ok": True}, finished_at=utcnow())
        )
        session.commit()


class LongPoll(threading.Thread):
    """A sim job submitted, then ``GET /v1/jobs/{id}?wait=10`` in a thread of its own."""

    def __init__(self, api: Served, auth: dict[str, str]) -> None:
        super().__init__()
        self.url = f"{api.base}/v1/jobs"
        self.auth = auth
        self.job_id = webclient.post(
            self.url, json={"model": "sim", "input": {"cost": 1}}, headers=auth
        ).json()["id"]
        self.started_at = self.answered_at = 0.0
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.started_at = time.monotonic()
        self.response = webclient.get(
            f"{self.url}/{self.job_id}?wait=10", headers=self.auth, timeout=20
        )
        self.answered_at = time.monotonic()

    def status(self) -> str:
        assert self.response is not None
        return str(self.response.json()["status"])


def test_a_long_poll_reads_its_row_only_when_woken_and_wakes_within_milliseconds(
    settings: Settings, sessions: sessionmaker[Session], token: str, key_prefix: str
) -> None:
    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    with served(settings) as api:
        poll = LongPoll(api, {"Authorization": f"Bearer {token}"})
        reads_before = api.count("SELECT JOBS")
        poll.start()
        time.sleep(2.5)  # the old long-poll re-read its row every second
        reads_waiting = api.count("SELECT JOBS") - reads_before
        _finish(sessions, poll.job_id)
        published_at = time.monotonic()
        client.publish(done_channel(key_prefix), poll.job_id)
        poll.join(timeout=10)
    # None while waiting, not even a first one: the job was accepted by this process,
    # which knows it has not ended until its completion comes (a job another process
    # accepted is read once first: tests/integration/test_hot_path_cost.py).
    assert reads_waiting == 0
    assert poll.status() == "succeeded"
    assert poll.answered_at - published_at < 0.25


def test_a_completion_never_published_costs_one_wait_not_every_one(
    settings: Settings, sessions: sessionmaker[Session], token: str
) -> None:
    """A job this process accepted is not read before a wait until its completion comes;
    one whose completion never comes (a worker that wrote the row and died before it
    published) is found ended by the read at the first wait's end, and forgotten: the
    next wait answers at once."""
    auth = {"Authorization": f"Bearer {token}"}
    with served(settings) as api:
        job_id = webclient.post(
            f"{api.base}/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=auth
        ).json()["id"]
        _finish(sessions, job_id)  # and nothing published
        url = f"{api.base}/v1/jobs/{job_id}"
        started = time.monotonic()
        first = webclient.get(f"{url}?wait=1", headers=auth, timeout=20)
        first_s = time.monotonic() - started
        started = time.monotonic()
        second = webclient.get(f"{url}?wait=10", headers=auth, timeout=20)
        second_s = time.monotonic() - started
    assert first.json()["status"] == second.json()["status"] == "succeeded"
    assert first_s >= 0.9  # the wait's length, then the read at its end
    assert second_s < 2.0  # read first: no wait at all


def test_a_long_poll_survives_a_redis_reconnect_and_a_completion_it_missed(
    settings: Settings, sessions: sessionmaker[Session], token: str, tmp_path: Path
) -> None:
    # A Redis of its own: cutting every pub/sub client of a shared one would cut
    # other tests' subscriptions too.
    with started_redis(tmp_path / "redis") as url:
        _survives_a_reconnect(settings.model_copy(update={"redis_url": url}), sessions, token)


def _survives_a_reconnect(settings: Settings, sessions: sessionmaker[Session], token: str) -> None:
    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    with served(settings) as api:
        poll = LongPoll(api, {"Authorization": f"Bearer {token}"})
        poll.start()
        time.sleep(0.5)
        # Cut the API's subscription, and finish the job while it is down: the
        # completion's message reaches nobody.
        assert client.client_kill_filter(_type="pubsub") >= 1
        _finish(sessions, poll.job_id)
        poll.join(timeout=15)
    assert poll.status() == "succeeded"
    # Answered after the resubscription (about a second), not at the wait's end.
    assert poll.answered_at - poll.started_at < 5.0
