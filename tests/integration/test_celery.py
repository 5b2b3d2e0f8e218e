"""The Celery app on the real broker: the purge and feeder tasks, run by a real worker."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Callable

from celery.contrib.testing.worker import start_worker
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import Backfill, Job, WebhookDelivery, utcnow
from tests.integration.conftest import RunningLoop
from workers.tasks.app import FEED_TASK, PURGE_TASK, create_celery, purge_results


def add_job(session: Session, key_id: str, status: str, finished_ago_s: float | None) -> str:
    now = utcnow()
    job = Job(
        id=str(uuid.uuid4()),
        api_key_id=key_id,
        model="sim",
        priority="normal",
        status=status,
        input={"cost": 1},
        cost=1,
        attempts=0,
        created_at=now - dt.timedelta(days=30),
        finished_at=now - dt.timedelta(seconds=finished_ago_s) if finished_ago_s else None,
    )
    session.add(job)
    session.commit()
    return job.id


def seed(sessions: sessionmaker[Session], ttl_s: float) -> dict[str, str]:
    with sessions() as session:
        key = create_key(session, "purge").id
        return {
            "old_done": add_job(session, key, "succeeded", ttl_s * 2),
            "old_failed": add_job(session, key, "failed", ttl_s * 2),
            "fresh_done": add_job(session, key, "succeeded", ttl_s / 2),
            "queued": add_job(session, key, "queued", None),
        }


def remaining(sessions: sessionmaker[Session], ids: dict[str, str]) -> set[str]:
    with sessions() as session:
        present = {j.id for j in session.query(Job).filter(Job.id.in_(ids.values()))}
    return {name for name, job_id in ids.items() if job_id in present}


def test_purge_deletes_only_old_terminal_jobs(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ids = seed(sessions, settings.result_ttl_s)
    assert purge_results(settings) == 2
    assert remaining(sessions, ids) == {"fresh_done", "queued"}


def test_a_real_celery_worker_runs_the_purge_task(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ids = seed(sessions, settings.result_ttl_s)
    app = create_celery(settings)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        app.send_task(PURGE_TASK)
        until = time.monotonic() + 20
        while remaining(sessions, ids) != {"fresh_done", "queued"}:
            assert time.monotonic() < until, remaining(sessions, ids)
            time.sleep(0.1)
    assert remaining(sessions, ids) == {"fresh_done", "queued"}


def test_purge_removes_finished_backfills_and_deliveries_past_the_ttl(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    now = utcnow()
    old = now - dt.timedelta(seconds=settings.result_ttl_s * 2)
    with sessions() as session:
        key = create_key(session, "purge").id
        for backfill_id, status, finished in [
            ("00000000-0000-4000-8000-000000000001", "completed", old),
            ("00000000-0000-4000-8000-000000000002", "completed", now),
            ("00000000-0000-4000-8000-000000000003", "in_progress", None),
        ]:
            session.add(
                Backfill(id=backfill_id, api_key_id=key, model="sim", status=status,
                         total=0, completed=0, failed=0, expired=0, cancelled=0,
                         fed_through=0, input_bytes=0, created_at=old, updated_at=old,
                         finished_at=finished)
            )  # fmt: skip
        session.add(
            WebhookDelivery(id="msg_old", api_key_id=key, event_type="job.succeeded",
                            url="https://example.com/", payload="{}", status="delivered",
                            attempts=1, step=0, created_at=old, finished_at=old)
        )  # fmt: skip
        session.commit()
    purge_results(settings)
    with sessions() as session:
        left = set(session.scalars(select(Backfill.id)))
        assert left == {
            "00000000-0000-4000-8000-000000000002",
            "00000000-0000-4000-8000-000000000003",
        }
        assert session.get(WebhookDelivery, "msg_old") is None


def test_a_real_celery_worker_feeds_a_backfill_to_completion(
    settings: Settings,
    sessions: sessionmaker[Session],
    client: TestClient,
    auth: dict[str, str],
    sim_worker: Callable[..., RunningLoop],
) -> None:
    lines = "".join(
        json.dumps({"custom_id": f"r{i}", "input": {"cost": 1}}) + "\n" for i in range(400)
    )
    created = client.post(
        "/v1/backfills", params={"model": "sim"}, content=lines.encode(), headers=auth
    ).json()
    fast = settings.model_copy(
        update={
            "backfill_feed_budget_s": 30.0,
            "backfill_outstanding": 100,
            "backfill_feed_chunk": 50,
        }
    )
    app = create_celery(fast)
    with (
        start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10),
        sim_worker(),
    ):
        app.send_task(FEED_TASK)
        until = time.monotonic() + 60
        while True:
            status = client.get(f"/v1/backfills/{created['id']}", headers=auth).json()
            if status["status"] == "completed":
                break
            assert time.monotonic() < until, status
            time.sleep(0.2)
    assert status["request_counts"]["completed"] == 400
