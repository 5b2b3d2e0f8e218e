"""The Celery app on the real broker: the purge task, run by a real worker."""

from __future__ import annotations

import datetime as dt
import time
import uuid

from celery.contrib.testing.worker import start_worker
from sqlalchemy.orm import Session, sessionmaker

from core.db import Job, utcnow
from core.keys import create_key
from core.settings import Settings
from workers.celery_app import PURGE_TASK, create_celery, purge_results


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
