"""Each key's outstanding-jobs counter: moved with the rows, repaired by the reconciler."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Job, KeyUsage
from core.db.usage import rebuild, reserve
from tests.integration.conftest import RunningLoop
from workers.tasks.reconcile import reconcile


def _outstanding(sessions: sessionmaker[Session]) -> dict[str, int]:
    with sessions() as session:
        return dict(session.execute(select(KeyUsage.api_key_id, KeyUsage.outstanding)).all())


def test_the_counter_follows_submissions_results_and_cancellations(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    sim_worker: Callable[..., RunningLoop],
) -> None:
    ids = [
        client.post("/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=auth).json()[
            "id"
        ]
        for _ in range(6)
    ]
    assert list(_outstanding(sessions).values()) == [6]
    assert client.delete(f"/v1/jobs/{ids[0]}", headers=auth).status_code == 200
    assert list(_outstanding(sessions).values()) == [5]
    with sim_worker():
        for job_id in ids[1:]:
            done = client.get(f"/v1/jobs/{job_id}?wait=10", headers=auth).json()
            assert done["status"] == "succeeded"
    assert list(_outstanding(sessions).values()) == [0]


def test_reserve_admits_up_to_the_limit_and_counts_only_what_it_admits(
    sessions: sessionmaker[Session], token: str
) -> None:
    key_id = token.split("_")[1]
    with sessions() as session:
        assert reserve(session, {key_id: 7}, 10) == {key_id: 7}
        assert reserve(session, {key_id: 7}, 10) == {key_id: 3}
        assert reserve(session, {key_id: 1}, 10) == {key_id: 0}
        assert reserve(session, {key_id: 4}, None) == {key_id: 4}  # no limit
        session.commit()
    assert _outstanding(sessions) == {key_id: 14}


def test_the_reconciler_repairs_a_counter_changed_by_hand_and_logs_it(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = [
        client.post("/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=auth).json()[
            "id"
        ]
        for _ in range(4)
    ]
    with sessions() as session:
        # By hand, behind Ferry's back: a job deleted, a counter overwritten.
        session.execute(update(Job).where(Job.id == ids[0]).values(status="failed"))
        session.execute(update(KeyUsage).values(outstanding=40))
        session.commit()
    with sessions() as session:
        assert rebuild(session) == 1
        session.commit()
    assert list(_outstanding(sessions).values()) == [3]
    with sessions() as session:
        session.execute(update(KeyUsage).values(outstanding=0))
        session.commit()
    client_redis = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    with caplog.at_level(logging.WARNING, logger="core.db.usage"):
        reconcile(sessions, client_redis, settings.key_prefix, grace_s=60)
    assert list(_outstanding(sessions).values()) == [3]
    assert "outstanding-jobs counter repaired" in caplog.text
