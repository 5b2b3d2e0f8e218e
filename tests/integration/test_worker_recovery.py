"""A worker outlives a Redis restart and carries on where it was."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from ferry.local_redis import start_redis
from harness.ports import free_port
from tests.integration.conftest import RunningLoop, build_sim_loop, submit, wait_terminal

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


def test_worker_survives_a_redis_restart(
    settings: Settings, token: str, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    port = free_port()
    redis_dir = tmp_path / "own-redis"
    process, url = start_redis(redis_dir, port)
    own = settings.model_copy(update={"redis_url": url})
    auth = {"Authorization": f"Bearer {token}"}
    running = RunningLoop(build_sim_loop(own))
    try:
        with running, TestClient(create_app(own)) as client:
            before = [submit(client, auth, model="sim", input={"cost": 1}) for _ in range(3)]
            assert {r.status for r in wait_terminal(sessions, before).values()} == {"succeeded"}

            process.terminate()
            process.wait(timeout=10)
            time.sleep(1.5)  # the loop meets connection errors and backs off
            assert running.thread.is_alive()

            process, _ = start_redis(redis_dir, port)  # same data (AOF), same port
            after = [submit(client, auth, model="sim", input={"cost": 1}) for _ in range(3)]
            rows = wait_terminal(sessions, after, timeout=30)
            assert {r.status for r in rows.values()} == {"succeeded"}
    finally:
        process.terminate()
        process.wait(timeout=10)
