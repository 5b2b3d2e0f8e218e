"""Shared fixtures: a real Redis and real databases (SQLite and PostgreSQL).

A service that cannot be reached on a fresh machine is started (redis-server)
or its tests skip with the reason; under CI=true nothing may skip for a
missing service.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, delete, text
from sqlalchemy.engine import make_url

from core import migrate
from core.db import Base, make_engine
from ferry.local_redis import find_redis_server, free_port, start_redis

IN_CI = os.environ.get("CI", "").lower() == "true"
POSTGRES_ADMIN_URL = os.environ.get(
    "FERRY_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def missing_service(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: services must be there)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """FERRY_TEST_REDIS_URL, else the local Redis on 6379, else one we start."""
    url = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        client.ping()
        yield url
        return
    except redis.RedisError:
        pass
    finally:
        client.close()
    try:
        find_redis_server()
    except SystemExit as exc:
        missing_service(str(exc))
    process, started_url = start_redis(tmp_path_factory.mktemp("redis"), free_port())
    try:
        yield started_url
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix of this test's own, deleted afterwards."""
    prefix = f"ferrytest-{secrets.token_hex(4)}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A PostgreSQL database of its own (``ferry_test_<hex>``), dropped afterwards."""
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        admin.dispose()
        missing_service(f"PostgreSQL unreachable at {make_url(POSTGRES_ADMIN_URL).host}: {exc}")
    name = f"ferry_test_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def migrated_database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A database of this test session's own, migrated to head, per backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'ferry.db'}"
        migrate.upgrade(url)
        yield url
        return
    with postgres_database() as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture
def database_url(migrated_database_url: str) -> Iterator[str]:
    """The session's database, emptied after each test."""
    yield migrated_database_url
    engine = make_engine(migrated_database_url)
    try:
        with engine.begin() as conn:
            # Children before parents: every table, in reverse dependency order.
            for table in reversed(Base.metadata.sorted_tables):
                conn.execute(delete(table))
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def run_ferry(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    """Run the ferry command as a user would; returns stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "ferry", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
