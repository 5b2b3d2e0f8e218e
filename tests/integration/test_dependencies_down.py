"""When Redis or the database is unreachable the API says so, and loses nothing accepted."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.state import app_state
from core.config.settings import Settings
from core.db import schema as db
from core.db.schema import Job
from ferry.local_redis import free_port
from tests.integration.conftest import RunningLoop, build_sim_loop, wait_terminal
from workers.gpu.recording import connection_lost
from workers.tasks.reconcile import reconcile


def test_submit_with_redis_down_is_accepted_and_enqueued_when_redis_is_back(
    settings: Settings, token: str, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    down = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    with TestClient(create_app(down)) as client:
        auth = {"Authorization": f"Bearer {token}"}
        response = client.post(
            "/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=auth
        )
        # Committed, so accepted: durable in the database, with no estimate.
        assert response.status_code == 202, response.text
        assert response.json()["status"] == "queued"
        assert response.json()["estimated_wait_ms"] is None
        # Still ready: it accepts jobs; Redis's state is reported.
        ready = client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["checks"]["redis"].startswith("unreachable")
        assert ready.json()["checks"]["database"] == "ok"
        # A deadline sooner than the reconciler can enqueue is refused, not stored.
        short = client.post(
            "/v1/jobs",
            json={"model": "sim", "input": {"cost": 1}, "deadline_ms": 5000},
            headers=auth,
        )
        assert short.status_code == 503
        assert short.headers["Retry-After"]
        # Its row deleted again, the API's record of jobs it accepted holds only the first.
        accepted = response.json()["id"]
        with sessions() as session:
            key_id = session.get_one(Job, accepted).api_key_id
        hub = app_state(client.app).hub
        assert len(hub) == 1 and hub.unended(accepted, key_id)
    with sessions() as session:
        assert session.query(Job).count() == 1
    job_id = response.json()["id"]
    assert settings.redis_url
    back = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=settings.reconcile_grace_s + 1)
    assert reconcile(sessions, back, settings.key_prefix, settings.reconcile_grace_s, later) == 1
    with RunningLoop(build_sim_loop(settings)):
        rows = wait_terminal(sessions, [job_id])
    assert rows[job_id].status == "succeeded"


def test_database_down_is_a_503_not_a_500(settings: Settings) -> None:
    down = settings.model_copy(
        update={"database_url": f"postgresql+psycopg://ferry@127.0.0.1:{free_port()}/none"}
    )
    with TestClient(create_app(down)) as client:
        auth = {"Authorization": "Bearer fy_0123456789abcdef_secret"}
        for method, path in [("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/v1/models")]:
            response = client.request(
                method, path, json={"model": "sim", "input": {"cost": 1}}, headers=auth
            )
            assert response.status_code == 503, (method, path, response.text)
            assert response.json()["error"] == {
                "type": "unavailable",
                "message": "the database is unavailable; retry shortly",
            }
            assert response.headers["Retry-After"] == "2"
        ready = client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["database"].startswith("unreachable")


def test_models_with_redis_down_is_a_503(settings: Settings, token: str) -> None:
    down = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    with TestClient(create_app(down)) as client:
        response = client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert response.status_code == 503
        assert "Redis" in response.json()["error"]["message"]


def test_a_process_stopped_inside_a_transaction_loses_it_and_its_locks(
    postgres_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seconds, not the default's ten, so that the test does not wait them out.
    monkeypatch.setattr(db, "IDLE_IN_TRANSACTION_S", 1)
    stopped_engine, other_engine = (
        db.make_engine(postgres_database),
        db.make_engine(postgres_database),
    )
    try:
        with other_engine.connect() as other:
            assert other.scalar(text("SHOW idle_in_transaction_session_timeout")) == "1s"
            other.execute(text("CREATE TABLE counts (id int PRIMARY KEY, n int)"))
            other.execute(text("INSERT INTO counts VALUES (1, 0)"))
            other.commit()
        stopped = stopped_engine.connect()
        # It locks the row and stops there, as a process SIGSTOPped mid-transaction.
        stopped.execute(text("UPDATE counts SET n = n + 1 WHERE id = 1"))
        with other_engine.connect() as other:
            # The other waits for the lock until the server ends the stopped one's session.
            other.execute(text("SET lock_timeout = '30s'"))
            other.execute(text("UPDATE counts SET n = n + 10 WHERE id = 1"))
            other.commit()
            assert other.scalar(text("SELECT n FROM counts")) == 10
        # Resumed, it finds its transaction gone (its write never happened), and a
        # worker's result write takes that for a lost connection, to retry.
        with pytest.raises(DBAPIError) as resumed:
            stopped.execute(text("UPDATE counts SET n = n + 1 WHERE id = 1"))
        assert connection_lost(resumed.value)
        stopped.close()
        with other_engine.connect() as other:
            assert other.scalar(text("SELECT n FROM counts")) == 10
    finally:
        stopped_engine.dispose()
        other_engine.dispose()


def test_a_batch_recorded_and_not_acknowledged_is_said_so_and_not_run_again(
    settings: Settings,
    token: str,
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = build_sim_loop(settings)
    consumer = loop.intake.consumer
    acknowledge = consumer.ack
    refused: list[int] = []

    def ack_refused_once(*args: object, **kwargs: object) -> None:
        if not refused:
            refused.append(1)
            raise redis.ConnectionError("Redis went away during the acknowledgement")
        acknowledge(*args, **kwargs)  # type: ignore[arg-type]

    consumer.ack = ack_refused_once  # type: ignore[method-assign]
    with TestClient(create_app(settings)) as client:
        response = client.post(
            "/v1/jobs",
            json={"model": "sim", "input": {"cost": 1}},
            headers={"Authorization": f"Bearer {token}"},
        )
    job_id = response.json()["id"]
    with caplog.at_level("WARNING"), RunningLoop(loop):
        wait_terminal(sessions, [job_id])
        # The loop hears of the refusal, reads its entry again, finds the job finished.
        until = time.monotonic() + 15
        while loop.held_count or not refused:
            assert time.monotonic() < until, "the entry was never acknowledged"
            time.sleep(0.05)
    rows = wait_terminal(sessions, [job_id])
    assert refused and rows[job_id].status == "succeeded" and rows[job_id].attempts == 1
    # Whichever path hears of it (the step, or the settling before a re-read or a stop),
    # nothing says the results were lost: they were committed.
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "were not recorded" in m], said
