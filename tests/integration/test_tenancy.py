"""Two tenants: every endpoint that names an object refuses the other key's exactly as it
refuses a missing one (same status, same message shape), and changes nothing of it."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from core.db.keys import create_key
from tests.integration.test_backfills import ndjson

JOB_PATHS = [
    ("GET", "/v1/jobs/{id}"),
    ("DELETE", "/v1/jobs/{id}"),
    ("GET", "/v1/jobs/{id}/deliveries"),
    ("POST", "/v1/jobs/{id}/deliveries/redeliver"),
]
BACKFILL_PATHS = [("GET", "/v1/backfills/{id}"), ("GET", "/v1/backfills/{id}/results"),
                  ("POST", "/v1/backfills/{id}/cancel")]  # fmt: skip


def _headers(sessions: sessionmaker[Session], name: str) -> dict[str, str]:
    with sessions() as session:
        return {"Authorization": f"Bearer {create_key(session, name).token}"}


def _refusal(response: Any, object_id: str) -> tuple[int, Any]:
    """The answer with the id taken out: what must not tell 'theirs' from 'missing'."""
    return response.status_code, response.text.replace(object_id, "<id>")


def test_no_endpoint_shows_or_changes_another_tenants_objects(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    alice, mallory = _headers(sessions, "alice"), _headers(sessions, "mallory")
    job = client.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 1}, "metadata": {"owner": "alice"}},
        headers=alice,
    ).json()
    backfill = client.post(
        "/v1/backfills", params={"model": "sim"}, content=ndjson(3), headers=alice
    ).json()
    missing = str(uuid.uuid4())
    for paths, theirs in ((JOB_PATHS, job["id"]), (BACKFILL_PATHS, backfill["id"])):
        for method, template in paths:
            foreign = client.request(method, template.format(id=theirs), headers=mallory)
            absent = client.request(method, template.format(id=missing), headers=mallory)
            assert foreign.status_code == 404, (method, template, foreign.text)
            assert _refusal(foreign, theirs) == _refusal(absent, missing), (method, template)
            assert "alice" not in foreign.text
    # Lists show only the caller's own, including a backfill's items asked for by id.
    assert client.get("/v1/jobs", headers=mallory).json()["data"] == []
    assert client.get("/v1/backfills", headers=mallory).json()["data"] == []
    items = client.get(f"/v1/jobs?backfill_id={backfill['id']}", headers=mallory)
    assert items.status_code == 200 and items.json()["data"] == []
    # Each key signs with its own secret.
    mine = client.get("/v1/webhook-secret", headers=alice).json()
    theirs_secret = client.get("/v1/webhook-secret", headers=mallory).json()
    assert mine != theirs_secret
    # Nothing of alice's changed: the job is still queued, the backfill not cancelled.
    assert client.get(f"/v1/jobs/{job['id']}", headers=alice).json()["status"] == "queued"
    after = client.get(f"/v1/backfills/{backfill['id']}", headers=alice).json()
    assert after["status"] not in ("cancelling", "cancelled")
    own_items = client.get(f"/v1/jobs?backfill_id={backfill['id']}", headers=alice).json()
    assert len(own_items["data"]) == 3
