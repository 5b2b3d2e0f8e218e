"""Redis and PostgreSQL for tests and benchmarks: found where they run, started, or made fresh.

FERRY_TEST_REDIS_URL and FERRY_TEST_POSTGRES_URL name other servers than the
local defaults.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from core.db import migrate
from ferry.local_redis import answers_as_itself, find_redis_server, start_redis
from harness.ports import free_port

POSTGRES_ADMIN_URL = os.environ.get(
    "FERRY_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


class ServiceMissing(Exception):
    """A service is neither reachable nor startable; the message says which, and why."""


def reachable_redis() -> str | None:
    """FERRY_TEST_REDIS_URL (else the Redis on 6379) if it answers within a second."""
    url = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError:
        return None
    finally:
        client.close()
    return url


def redis_server() -> str:
    """The redis-server program to start Redis with."""
    try:
        return find_redis_server()
    except SystemExit as exc:  # what the `ferry up` command exits with
        raise ServiceMissing(str(exc)) from None


def redis_with_conf(
    program: str, home: Path, port: int, lines: list[str], *args: str
) -> subprocess.Popen[bytes]:
    """A redis-server on a loopback ``port``, its config ``lines`` beside the common ones (no
    persistence, data and log in ``home``)."""
    home.mkdir(parents=True, exist_ok=True)
    conf = home / "redis.conf"
    common = [
        f"port {port}",
        "bind 127.0.0.1",
        f'dir "{home}"',
        'save ""',
        "appendonly no",
        "protected-mode no",
    ]
    conf.write_text("\n".join(common + lines) + "\n")
    return subprocess.Popen(
        [program, str(conf), *args], stdout=(home / "log").open("wb"), stderr=subprocess.STDOUT
    )


def redis_started(
    program: str,
    root: Path,
    lines: list[str],
    *args: str,
    port: Callable[[], int] = free_port,
    tries: int = 5,
    timeout_s: float = 60.0,
) -> tuple[int, subprocess.Popen[bytes]]:
    """A redis-server (``redis_with_conf``, its home ``root/redis-<port>``) answering on a
    port of ``port()``, as itself; that port and the process.

    A port is free when it is chosen and bound only when the server starts: in between,
    any process on the machine may take it (an outgoing connection's local port, where the
    kernel's ephemeral range is what ``port()`` draws from, or another server). A server
    that finds its port taken exits at start and is started again on another; one that
    answers is asked its ``process_id``, so that whoever else holds the port is never
    taken for it (``ferry.local_redis.answers_as_itself``). Anything else that stops it
    raises RedisStartError, with the end of its log."""
    for _ in range(tries):
        chosen = port()
        home = root / f"redis-{chosen}"
        process = redis_with_conf(program, home, chosen, lines, *args)
        log = home / "log"

        def said(log: Path = log) -> str:
            return log.read_text(errors="replace") if log.exists() else ""

        if answers_as_itself(process, chosen, said, timeout_s):
            return chosen, process
    raise AssertionError(f"redis-server found its port taken {tries} times in a row")


def stop_all(processes: Iterable[subprocess.Popen[bytes]]) -> None:
    """Terminate every process, then wait for each (killing one that lingers)."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


@contextlib.contextmanager
def started_redis(data_dir: Path) -> Iterator[str]:
    """A redis-server of its own on a free port, stopped afterwards; yields its URL."""
    redis_server()
    process, url = start_redis(data_dir, free_port())
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextlib.contextmanager
def postgres_database(admin_url: str = POSTGRES_ADMIN_URL) -> Iterator[str]:
    """A PostgreSQL database of its own (``ferry_test_<hex>``), dropped afterwards."""
    admin = create_engine(
        admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
    )
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        admin.dispose()
        raise ServiceMissing(
            f"PostgreSQL unreachable at {make_url(admin_url).host}: {exc}"
        ) from exc
    name = f"ferry_test_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextlib.contextmanager
def migrated_postgres_database() -> Iterator[str]:
    """A PostgreSQL database of its own, migrated to head, dropped afterwards."""
    with postgres_database() as url:
        migrate.upgrade(url)
        yield url
