"""The Python client against a running stack: the API in uvicorn, a real worker, Redis, SQL."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from ferry_client import (
    AsyncClient,
    BadRequest,
    Client,
    Conflict,
    NotFound,
    Retries,
    Unauthorized,
)
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import Job, make_engine, make_sessionmaker
from harness.proxy import TcpProxy
from harness.served import Served, served
from harness.services import migrated_postgres_database
from tests.integration.conftest import RunningLoop
from tests.integration.test_backfills import RunningFeeder, make_feeder

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")

FAST = Retries(max_retries=6, base_s=0.05, max_backoff_s=0.5, max_retry_after_s=3.0)


class Wire:
    """What a client sent and was answered, with when: each request's idempotency key,
    each answer's status and Retry-After."""

    def __init__(self, client: Client) -> None:
        self.sent: list[tuple[float, str | None]] = []
        self.answered: list[tuple[float, int, str | None]] = []
        hooks = client._http.event_hooks
        hooks["request"].append(
            lambda r: self.sent.append((time.monotonic(), r.headers.get("Idempotency-Key")))
        )
        hooks["response"].append(
            lambda r: self.answered.append(
                (time.monotonic(), r.status_code, r.headers.get("Retry-After"))
            )
        )

    def clear(self) -> None:
        self.sent.clear()
        self.answered.clear()

    @property
    def statuses(self) -> list[int]:
        return [status for _, status, _ in self.answered]

    @property
    def keys(self) -> set[str | None]:
        return {key for _, key in self.sent}

    def refusals(self, status: int) -> list[tuple[float, float]]:
        """Per answer of ``status``: the seconds until the next request, and its Retry-After."""
        return [
            (min(at for at, _ in self.sent if at > refused_at) - refused_at, float(after or 0))
            for refused_at, code, after in self.answered
            if code == status
        ]


@pytest.fixture
def ferry(api: Served, token: str) -> Iterator[Client]:
    with Client(api.base, token, retries=FAST, timeout_s=10) as client:
        yield client


def test_run_submits_and_waits_in_one_round_trip(
    api: Served, token: str, sim_worker: Callable[..., RunningLoop]
) -> None:
    seen: list[tuple[str, str]] = []

    def log(request: httpx.Request) -> None:
        seen.append((request.method, request.url.path))

    with sim_worker(), Client(api.base, token, retries=FAST, max_wait_s=10) as ferry:
        ferry._http.event_hooks["request"].append(log)
        job = ferry.run("sim", {"cost": 3}, metadata={"who": "sdk"})
    assert job.done and job.status == "succeeded"
    assert job.output is not None and job.metadata == {"who": "sdk"}
    assert seen == [("POST", "/v1/jobs")]


def test_a_client_learns_the_servers_longest_wait_once(
    api: Served, token: str, sim_worker: Callable[..., RunningLoop]
) -> None:
    seen: list[int] = []
    with sim_worker(), Client(api.base, token, retries=FAST) as ferry:  # asks for 30 s
        ferry._http.event_hooks["response"].append(lambda r: seen.append(r.status_code))
        first = ferry.run("sim", {"cost": 1})
        second = ferry.run("sim", {"cost": 1})
    assert first.status == second.status == "succeeded"
    assert seen == [422, 200, 200]  # the server's bound (10 s) is kept from then on


def test_submit_get_wait_cancel_and_list(
    ferry: Client, sim_worker: Callable[..., RunningLoop]
) -> None:
    queued = ferry.submit("sim", {"cost": 1}, priority="vip")
    assert queued.status == "queued" and queued.priority == "vip"
    assert ferry.get(queued.id).id == queued.id
    cancelled = ferry.cancel(ferry.submit("sim", {"cost": 1}).id)
    assert cancelled.status == "cancelled"
    with pytest.raises(Conflict) as refused:
        ferry.cancel(cancelled.id)
    assert refused.value.status == 409 and refused.value.type == "conflict"
    more = [ferry.submit("sim", {"cost": 1}).id for _ in range(3)]
    with sim_worker():
        assert ferry.wait(queued.id, timeout_s=10).status == "succeeded"
        assert all(ferry.wait(job_id, timeout_s=10).done for job_id in more)
    listed = [job.id for job in ferry.jobs(page_size=2)]
    assert sorted(listed) == sorted([queued.id, cancelled.id, *more])
    assert [j.id for j in ferry.jobs(status="cancelled")] == [cancelled.id]
    assert "sim" in {model.name for model in ferry.models()}


def test_errors_carry_the_apis_type(api: Served, ferry: Client) -> None:
    with pytest.raises(BadRequest) as bad:
        ferry.submit("no-such-model", {"cost": 1})
    assert bad.value.status == 422 and "model" in bad.value.message
    with pytest.raises(NotFound) as missing:
        ferry.get("00000000-0000-4000-8000-000000000000")
    assert missing.value.type == "not_found"
    with (
        Client(api.base, "fy_not_a_key", retries=FAST) as stranger,
        pytest.raises(Unauthorized) as refused,
    ):
        stranger.models()
    assert refused.value.type == "unauthorized"


def test_a_rate_limited_submission_waits_out_retry_after_and_is_stored_once(
    settings: Settings, token: str, sessions: sessionmaker[Session]
) -> None:
    with (
        served(settings.model_copy(update={"rate_limit": "2/second"})) as api,
        Client(api.base, token, retries=FAST, timeout_s=10) as ferry,
    ):
        wire = Wire(ferry)
        jobs = [ferry.submit("sim", {"cost": n}) for n in range(1, 6)]
    refusals = wire.refusals(429)
    assert refusals, wire.answered  # five in a row at two a second: some were refused
    for waited, after in refusals:
        assert after >= 1 and waited >= after - 0.05
    assert wire.statuses.count(202) == 5
    with sessions() as session:
        stored = session.scalars(select(Job).where(Job.idempotency_key.is_not(None))).all()
    # Every retry repeated its submission's key: five keys, five rows, one job each.
    assert sorted(job.id for job in stored) == sorted(job.id for job in jobs)
    assert len(wire.keys) == 5


def test_a_backfill_from_lines_and_its_results(
    ferry: Client,
    sim_worker: Callable[..., RunningLoop],
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
    settings: Settings,
) -> None:
    lines = [{"custom_id": f"c{n}", "input": {"cost": 1 + n % 3}} for n in range(20)]
    progress: list[tuple[int, int | None]] = []
    backfill = ferry.backfills.submit(
        lines, model="sim", progress=lambda done, total: progress.append((done, total))
    )
    assert backfill.request_counts.total == 20
    assert progress and progress[-1][0] > 0
    with sim_worker(), RunningFeeder(make_feeder(sessions, redis_client, settings)):
        finished = ferry.backfills.wait(backfill.id, timeout_s=60, poll_s=0.2)
    assert finished.status == "completed"
    results = list(ferry.backfills.results(backfill.id))
    assert [r["custom_id"] for r in results] == [f"c{n}" for n in range(20)]
    assert {r["status"] for r in results} == {"succeeded"}


def test_a_thousand_jobs_through_a_hundred_concurrent_runs(
    api: Served,
    token: str,
    sessions: sessionmaker[Session],
    sim_worker: Callable[..., RunningLoop],
) -> None:
    async def main() -> list[Any]:
        gate = asyncio.Semaphore(100)
        async with AsyncClient(api.base, token, retries=FAST, timeout_s=60) as ferry:

            async def one(n: int) -> Any:
                async with gate:
                    return await ferry.run("sim", {"cost": 1 + n % 4}, timeout_s=60)

            return await asyncio.gather(*(one(n) for n in range(1000)))

    with sim_worker():
        jobs = asyncio.run(main())
    assert len({job.id for job in jobs}) == 1000
    assert {job.status for job in jobs} == {"succeeded"}
    with sessions() as session:
        stored = session.scalar(select(func.count()).select_from(Job))
    assert stored == 1000  # none twice, none lost


def test_a_submission_through_a_database_outage_is_retried_and_stored_once(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """The outage is a PostgreSQL server cut off behind a proxy: this test makes a
    PostgreSQL database of its own (a missing server skips it, and fails it under CI=true)."""
    with migrated_postgres_database() as database:
        url = make_url(database)
        proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
        through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        settings = Settings(
            redis_url=redis_url, database_url=through, key_prefix=key_prefix,
            data_dir=tmp_path, models="sim", max_wait_s=10.0,
        )  # fmt: skip
        engine = make_engine(database)
        sessions = make_sessionmaker(engine)
        with sessions() as session:
            token = create_key(session, "outage").token
        try:
            with (
                served(settings) as api,
                Client(api.base, token, retries=FAST, timeout_s=10) as ferry,
            ):
                wire = Wire(ferry)
                ferry.submit("sim", {"cost": 1})  # the pool is warm
                wire.clear()
                proxy.cut()
                healed = threading.Timer(1.5, proxy.restore)
                healed.start()
                job = ferry.submit("sim", {"cost": 2})  # the client makes the key
                healed.join()
            statuses, keys = wire.statuses, wire.keys
            assert 503 in statuses and statuses[-1] == 202, statuses  # refused, then retried
            assert len(wire.sent) == len(statuses) > 1 and len(keys) == 1 and None not in keys
            # The API's 503 says Retry-After: 2; the client waited that long before retrying.
            waited, after = wire.refusals(503)[0]
            assert after == 2 and waited >= 1.9
            assert job.status == "queued"
            with sessions() as session:
                rows = session.scalars(select(Job).where(Job.idempotency_key.in_(keys)))
                assert [row.id for row in rows] == [job.id]
        finally:
            proxy.close()
            engine.dispose()
