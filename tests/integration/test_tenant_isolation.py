"""Two tenants over real HTTP: one Idempotency-Key used by both makes two jobs, one each
(sent one after the other and all at once, into the same commit groups), and the
long-poll and the event stream refuse the other tenant's job exactly as a missing one."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Job
from harness import webclient
from harness.served import served
from tests.integration.test_group_commit import post_all
from tests.integration.test_tenancy import _headers

BODY = {"model": "sim", "input": {"cost": 2}}


def _get(http: httpx.Client, url: str, headers: dict[str, str]) -> tuple[int, str, str]:
    """Status, content type and the body with its id taken out: an open event stream's
    body is left unread (it would not end), and shows as ''."""
    with http.stream("GET", url, headers=headers) as response:
        kind = response.headers.get("content-type", "")
        if response.status_code == 200 and kind.startswith("text/event-stream"):
            return response.status_code, kind, ""
        return response.status_code, kind, response.read().decode()


def test_one_idempotency_key_used_by_two_tenants_makes_a_job_for_each(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    alice, mallory = _headers(sessions, "alice"), _headers(sessions, "mallory")
    with served(settings) as api, webclient.client(base_url=api.base, timeout=30) as http:

        def submit(auth: dict[str, str], key: str, body: dict[str, Any]) -> httpx.Response:
            return http.post("/v1/jobs", json=body, headers={**auth, "Idempotency-Key": key})

        first = submit(alice, "shared-1", BODY)
        # The same body and key from the other tenant: a replay of alice's job would leak it.
        theirs = submit(mallory, "shared-1", BODY)
        assert (first.status_code, theirs.status_code) == (202, 202), theirs.text
        alices, mallorys = first.json()["id"], theirs.json()["id"]
        assert alices != mallorys
        assert "Idempotent-Replayed" not in theirs.headers
        # Each tenant's key still replays its own job, and only its own.
        for auth, own in ((alice, alices), (mallory, mallorys)):
            again = submit(auth, "shared-1", BODY)
            assert again.status_code == 202 and again.json()["id"] == own
            assert again.headers.get("Idempotent-Replayed") == "true"
        conflict = submit(mallory, "shared-1", {"model": "sim", "input": {"cost": 3}})
        assert conflict.status_code == 409 and alices not in conflict.text
        # Each sees its own job, and the other's as missing.
        for auth, own, other in ((alice, alices, mallorys), (mallory, mallorys, alices)):
            assert http.get(f"/v1/jobs/{own}", headers=auth).json()["id"] == own
            assert http.get(f"/v1/jobs/{other}", headers=auth).status_code == 404
            assert [j["id"] for j in http.get("/v1/jobs", headers=auth).json()["data"]] == [own]

        # All at once, alternating tenants: most land in the same commit groups.
        headers = [{**(alice, mallory)[i % 2], "Idempotency-Key": "shared-2"} for i in range(40)]
        responses = post_all(api.base, [BODY] * 40, headers, lambda _r: None)
    assert [r.status_code for r in responses] == [202] * 40
    ids = [{r.json()["id"] for r in responses[side::2]} for side in (0, 1)]
    assert all(len(each) == 1 for each in ids) and ids[0] != ids[1], ids
    with sessions() as session:
        rows = session.execute(select(Job.id, Job.api_key_id, Job.idempotency_key)).all()
    assert len(rows) == 4
    owners = {(row.idempotency_key, row.api_key_id) for row in rows}
    assert len(owners) == 4  # one job per tenant and key


def test_the_long_poll_and_the_event_stream_refuse_another_tenants_job_as_missing(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    alice, mallory = _headers(sessions, "alice"), _headers(sessions, "mallory")
    missing = str(uuid.uuid4())
    with served(settings) as api, webclient.client(base_url=api.base, timeout=30) as http:
        job = http.post("/v1/jobs", json=BODY, headers=alice).json()["id"]
        for path in ("/v1/jobs/{id}?wait=5", "/v1/jobs/{id}/events"):
            began = time.monotonic()
            status, kind, text = _get(http, path.format(id=job), mallory)
            took = time.monotonic() - began
            absent = _get(http, path.format(id=missing), mallory)
            assert (status, kind) == (404, "application/json"), (path, text)
            assert (status, kind, text.replace(job, "<id>")) == (
                absent[0],
                absent[1],
                absent[2].replace(missing, "<id>"),
            ), path
            assert "alice" not in text
            # Refused at once: no waiting on (and so no timing signal from) their job.
            assert took < 2.5, (path, took)
        # The owner's long-poll and stream answer on the same paths.
        own = _get(http, f"/v1/jobs/{job}?wait=0.2", alice)
        assert own[0] == 200 and '"status":"queued"' in own[2].replace(" ", "")
        streamed = _get(http, f"/v1/jobs/{job}/events", alice)
        assert streamed[0] == 200 and streamed[1].startswith("text/event-stream"), streamed
