"""POST /v1/jobs?wait=S: one round trip, the job durable either way (real Redis, real worker)."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi.testclient import TestClient

from tests.integration.conftest import RunningLoop


def test_a_job_that_finishes_within_the_wait_comes_back_finished(
    client: TestClient, auth: dict[str, str], sim_worker: Callable[..., RunningLoop]
) -> None:
    with sim_worker():
        response = client.post(
            "/v1/jobs?wait=8", json={"model": "sim", "input": {"cost": 3}}, headers=auth
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "succeeded"
    assert body["output"] is not None
    assert response.headers["Location"] == f"/v1/jobs/{body['id']}"
    # The same job a read gives.
    again = client.get(f"/v1/jobs/{body['id']}", headers=auth).json()
    assert again["status"] == "succeeded" and again["output"] == body["output"]


def test_a_job_still_queued_when_the_wait_ends_is_a_202_and_runs_later(
    client: TestClient, auth: dict[str, str], sim_worker: Callable[..., RunningLoop]
) -> None:
    started = time.monotonic()
    response = client.post(
        "/v1/jobs?wait=0.4", json={"model": "sim", "input": {"cost": 1}}, headers=auth
    )
    waited = time.monotonic() - started
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "queued"
    assert waited >= 0.4
    job_id = response.json()["id"]
    with sim_worker():
        finished = client.get(f"/v1/jobs/{job_id}?wait=8", headers=auth).json()
    assert finished["status"] == "succeeded"


def test_a_replay_of_a_finished_job_with_a_wait_is_answered_at_once(
    client: TestClient, auth: dict[str, str], sim_worker: Callable[..., RunningLoop]
) -> None:
    headers = {**auth, "Idempotency-Key": "wait-replay"}
    body = {"model": "sim", "input": {"cost": 2}}
    with sim_worker():
        first = client.post("/v1/jobs?wait=8", json=body, headers=headers)
    assert first.status_code == 200, first.text
    started = time.monotonic()
    replay = client.post("/v1/jobs?wait=8", json=body, headers=headers)
    assert time.monotonic() - started < 4.0
    assert replay.status_code == 200
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == first.json()["id"]
    assert replay.json()["status"] == "succeeded"
    # Without a wait a replay keeps the submission's status code.
    assert client.post("/v1/jobs", json=body, headers=headers).status_code == 202


def test_a_wait_longer_than_allowed_is_refused_before_anything_is_stored(
    client: TestClient, auth: dict[str, str]
) -> None:
    response = client.post(
        "/v1/jobs?wait=11", json={"model": "sim", "input": {"cost": 1}}, headers=auth
    )
    assert response.status_code == 422
    assert "wait: at most 10 seconds" in response.text
    assert response.json()["error"]["max_wait_s"] == 10  # a client may ask again within it
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []
    negative = client.post(
        "/v1/jobs?wait=-1", json={"model": "sim", "input": {"cost": 1}}, headers=auth
    )
    assert negative.status_code == 422 and "wait" in negative.text
