"""Fixtures for integration tests: the real app, real keys, a real worker loop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import DatabaseSettings, engine_for, make_sessionmaker
from harness.services import migrated_postgres_database
from workers.gpu.loop import BatchLoop
from workers.gpu.main import build_loop


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
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture
def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def build_sim_loop(settings: Settings, name: str = "test-worker") -> BatchLoop:
    return build_loop(settings, "sim", name=name)


class RunningLoop:
    def __init__(self, loop: BatchLoop) -> None:
        self.loop = loop
        self.stop = threading.Event()
        self.thread = threading.Thread(target=loop.run, args=(self.stop,), daemon=True)

    def __enter__(self) -> BatchLoop:
        self.thread.start()
        return self.loop

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "worker loop did not stop"


@pytest.fixture
def sim_worker(settings: Settings) -> Callable[..., RunningLoop]:
    def start(name: str = "test-worker") -> RunningLoop:
        return RunningLoop(build_sim_loop(settings, name))

    return start


@pytest.fixture
def postgres_database() -> Iterator[str]:
    """A PostgreSQL database of the test's own, migrated, dropped afterwards (for tests
    whose deployment is not the parametrized one)."""
    with migrated_postgres_database() as url:
        yield url
