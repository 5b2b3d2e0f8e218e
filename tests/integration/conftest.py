"""Fixtures and helpers for integration tests: the real app, real keys, real worker loops."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import pytest
import redis
from celery import Celery
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import DatabaseSettings, Job, engine_for, make_sessionmaker
from core.streams.broker import celery_for_events
from core.streams.target import RedisSettings, RedisTarget
from harness.served import Served, served
from harness.services import migrated_postgres_database
from harness.threads import OnAThread
from tests.streams import lane_pending
from workers.gpu.loop import BatchLoop
from workers.gpu.main import build_loop

if TYPE_CHECKING:
    from tests.integration.generation_worker import Worker


@pytest.fixture
def settings(redis_url: str, database_url: str, key_prefix: str, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=key_prefix,
        data_dir=tmp_path,
        models="minilm,resnet50,sim",
        model_parameters={
            "sim": {"latency_base_ms": 5.0, "latency_per_cost_ms": 0.1},
            # resnet50 jobs run on random weights (there are no weight files here).
            "resnet50": {"random_weights": True},
        },
        batch_max_size=8,
        batch_window_min_ms=20.0,
        batch_window_max_ms=20.0,
        max_body_bytes=64 * 1024,
        max_wait_s=10.0,
        # Three xdist workers share the machine's PostgreSQL (max_connections 100): at the
        # default 20 + 20 a process, two tests of 200 concurrent submissions at once took
        # every connection ("too many clients", 503 unavailable) from each other.
        db_pool_size=5,
        db_pool_overflow=10,
    )


@pytest.fixture
def sessions(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = engine_for(settings.section(DatabaseSettings))
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def make_token(sessions: sessionmaker[Session]) -> Callable[[str], str]:
    def make(name: str = "test") -> str:
        with sessions() as session:
            return create_key(session, name).token

    return make


@pytest.fixture
def token(make_token: Callable[[str], str]) -> str:
    return make_token("test")


@pytest.fixture
def admin(sessions: sessionmaker[Session]) -> dict[str, str]:
    """The headers of a key with the admin scope."""
    with sessions() as session:
        return {"Authorization": f"Bearer {create_key(session, 'ops', 'admin').token}"}


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture
def api(settings: Settings) -> Iterator[Served]:
    """The app in uvicorn on a port of its own, for the clients that need a real server."""
    with served(settings) as running:
        yield running


@pytest.fixture
def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def activate(client: TestClient, admin: dict[str, str], model: str, version: int) -> None:
    """Make ``version`` of ``model`` the active one, as an operator does."""
    response = client.post(
        f"/v1/admin/models/{model}/activate", json={"version": version}, headers=admin
    )
    assert response.status_code == 200, response.text


def submit(client: TestClient, auth: dict[str, str], **body: Any) -> str:
    response = client.post("/v1/jobs", json=body, headers=auth)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def wait_terminal(
    sessions: sessionmaker[Session], ids: list[str], timeout: float = 15
) -> dict[str, Job]:
    until = time.monotonic() + timeout
    while True:
        with sessions() as session:
            rows = {j.id: j for j in session.query(Job).filter(Job.id.in_(ids))}
        if all(r.status not in ("queued", "running") for r in rows.values()) and len(rows) == len(
            ids
        ):
            return rows
        assert time.monotonic() < until, {k: v.status for k, v in rows.items()}
        time.sleep(0.05)


@dataclass
class Stack:
    """What a test of the job path works through: the API with a key, the database its jobs
    are recorded in, the settings and Redis."""

    client: TestClient
    auth: dict[str, str]
    sessions: sessionmaker[Session]
    settings: Settings
    redis: redis.Redis

    def submit(self, **body: Any) -> str:
        return submit(self.client, self.auth, **body)

    def wait(self, ids: list[str], timeout: float = 15) -> dict[str, Job]:
        return wait_terminal(self.sessions, ids, timeout)

    def pending(self, lane: str = "normal") -> int:
        """How many of the sim model's entries in ``lane`` are read and not acknowledged."""
        return lane_pending(self.redis, self.settings.key_prefix, "sim", lane)


@pytest.fixture
def stack(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    settings: Settings,
    redis_client: redis.Redis,
) -> Stack:
    return Stack(client, auth, sessions, settings, redis_client)


def build_sim_loop(settings: Settings, name: str = "test-worker") -> BatchLoop:
    return build_loop(settings, "sim", name=name)


class Loop(Protocol):
    def run(self, stop: threading.Event) -> None: ...


L = TypeVar("L", bound=Loop)


class RunningLoop(Generic[L]):
    """``loop`` run on a thread of the test for a ``with`` block (which gets the loop); it
    must stop within ``join_s`` of the block's end."""

    join_s = 10.0

    def __init__(self, loop: L) -> None:
        self.loop = loop
        self.running = OnAThread(loop.run, self.join_s)
        self.stop, self.thread = self.running.stop, self.running.thread

    def __enter__(self) -> L:
        self.running.__enter__()
        return self.loop

    def __exit__(self, *exc: object) -> None:
        self.running.__exit__(*exc)
        assert not self.thread.is_alive(), f"{type(self.loop).__name__} did not stop"


@pytest.fixture
def sim_worker(settings: Settings) -> Callable[..., RunningLoop]:
    def start(name: str = "test-worker") -> RunningLoop:
        return RunningLoop(build_sim_loop(settings, name))

    return start


@pytest.fixture
def app(settings: Settings) -> Iterator[Celery]:
    """The Celery app the workers' events go out on (what Flower reads)."""
    app = celery_for_events(RedisTarget.of(settings.section(RedisSettings)))
    yield app
    app.close()


@pytest.fixture
def postgres_database() -> Iterator[str]:
    """A PostgreSQL database of the test's own, migrated, dropped afterwards (for tests
    whose deployment is not the parametrized one)."""
    with migrated_postgres_database() as url:
        yield url


# The generation fixtures serve the ``gen_settings`` of the module that asks for them (each
# generation module sizes its own model). The generation worker's module is imported only
# there: it brings torch.


@pytest.fixture
def gen_client(gen_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(gen_settings)) as test_client:
        yield test_client


@pytest.fixture
def gen_worker(gen_settings: Settings) -> Callable[..., Worker]:
    from tests.integration.generation_worker import start_worker

    def start(name: str = "gen-worker", settings: Settings | None = None) -> Worker:
        return start_worker(settings or gen_settings, name)

    return start
