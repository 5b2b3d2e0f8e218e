"""Per-key quotas: jobs queued or running, and unfinished backfill lines. Past them new work is
a 429 quota_exceeded naming the limit; what was accepted runs; other keys are not affected."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from backends.catalog import build_catalog
from core.config.settings import Settings
from core.db import backfills
from core.db.keys import create_key
from tests.integration.conftest import RunningLoop
from tests.integration.test_backfills import ndjson


@pytest.fixture
def capped(settings: Settings) -> Iterator[TestClient]:
    configured = settings.model_copy(
        update={"max_outstanding_jobs": 3, "max_outstanding_backfill_lines": 10}
    )
    with TestClient(create_app(configured)) as test_client:
        yield test_client


def _keys(sessions: sessionmaker[Session]) -> tuple[dict[str, str], dict[str, str]]:
    with sessions() as session:
        return (
            {"Authorization": f"Bearer {create_key(session, 'greedy').token}"},
            {"Authorization": f"Bearer {create_key(session, 'calm').token}"},
        )


def test_jobs_past_the_outstanding_quota_are_refused_until_some_finish(
    capped: TestClient,
    sessions: sessionmaker[Session],
    sim_worker: Callable[..., RunningLoop],
) -> None:
    greedy, calm = _keys(sessions)

    def submit(headers: dict[str, str], **extra: str) -> Any:
        body = {"model": "sim", "input": {"cost": 1}, **extra}
        return capped.post("/v1/jobs", json=body, headers=headers)

    accepted = [submit(greedy, idempotency_key=f"k{i}") for i in range(3)]
    assert [r.status_code for r in accepted] == [202, 202, 202]
    refused = submit(greedy)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "quota_exceeded"
    assert "FERRY_MAX_OUTSTANDING_JOBS" in error["message"]
    assert refused.headers["Retry-After"] == "5"
    # A replay of an accepted job is answered; another key has its own quota.
    replay = submit(greedy, idempotency_key="k0")
    assert replay.status_code == 202 and replay.headers["Idempotent-Replayed"] == "true"
    assert submit(calm).status_code == 202
    listed = capped.get("/v1/jobs", headers=greedy).json()["data"]
    assert len(listed) == 3  # nothing refused was stored
    with sim_worker():
        for job in listed:
            capped.get(f"/v1/jobs/{job['id']}?wait=10", headers=greedy)
    assert submit(greedy).status_code == 202


def test_backfill_lines_past_the_quota_are_refused_and_nothing_is_kept(
    capped: TestClient, sessions: sessionmaker[Session]
) -> None:
    greedy, calm = _keys(sessions)

    def upload(headers: dict[str, str], lines: int) -> Any:
        return capped.post(
            "/v1/backfills", params={"model": "sim"}, content=ndjson(lines), headers=headers
        )

    assert upload(greedy, 8).status_code == 202
    over = upload(greedy, 5)  # room for 2
    assert over.status_code == 429, over.text
    assert over.json()["error"]["type"] == "quota_exceeded"
    assert "room for 2" in over.json()["error"]["message"]
    assert len(capped.get("/v1/backfills", headers=greedy).json()["data"]) == 1
    assert upload(greedy, 2).status_code == 202
    full = upload(greedy, 1)  # refused before the body is read
    assert full.status_code == 429
    assert "room for 0" in full.json()["error"]["message"]
    assert upload(calm, 10).status_code == 202
    assert len(capped.get("/v1/backfills", headers=greedy).json()["data"]) == 2


def test_uploads_finishing_together_cannot_pass_the_backfill_quota(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Each upload counted its room at its start; the check at its end is the one that holds."""
    with sessions() as session:
        key_id = create_key(session, "racer").id
    spec = build_catalog(settings)["sim"]
    uploads = []
    for _ in range(3):  # all three started while nothing was outstanding
        backfill_id = backfills.start(sessions, key_id, "sim", None)
        ingest = backfills.Ingest(sessions, backfill_id, key_id, spec, 10)
        ingest.add(ndjson(5).splitlines())
        uploads.append(ingest)
    uploads[0].finish(max_outstanding=10)
    uploads[1].finish(max_outstanding=10)
    with pytest.raises(backfills.QuotaExceeded) as refused:
        uploads[2].finish(max_outstanding=10)
    assert refused.value.room == 0
    uploads[2].abort()
    with sessions() as session:
        assert backfills.outstanding_lines(session, key_id) == 10
