"""The job routes against a real Redis and real databases (SQLite, PostgreSQL)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.jobs import service as services
from api.state import app_state
from core.config.settings import Settings
from core.db.schema import Job
from core.streams.protocol import stream_key
from tests.integration.conftest import RunningLoop
from tests.streams import lane_messages


def submit(client: TestClient, auth: dict[str, str], **body: Any) -> Any:
    return client.post("/v1/jobs", json=body, headers=auth)


def test_submit_commits_the_row_then_queues_it_in_its_lane(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
    settings: Settings,
) -> None:
    response = submit(
        client,
        auth,
        model="sim",
        input={"cost": 7},
        priority="vip",
        deadline_ms=60_000,
        metadata={"team": "search"},
    )
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "queued"
    assert job["priority"] == "vip"
    assert job["metadata"] == {"team": "search"}
    assert response.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert response.headers["X-Request-ID"]

    with sessions() as session:
        row = session.get(Job, job["id"])
        assert row is not None
        assert (row.status, row.cost, row.input) == ("queued", 7, {"cost": 7})  # stored as sent
        assert row.deadline_at is not None

    messages = lane_messages(redis_client, settings.key_prefix, "sim", "vip")
    assert len(messages) == 1
    message = messages[0]
    assert (message.job_id, message.lane, message.cost) == (job["id"], "vip", 7)
    assert message.deadline_at_ms is not None
    assert message.request_id == response.headers["X-Request-ID"]
    with sessions() as session:
        assert message.tenant == session.get(Job, job["id"]).api_key_id  # type: ignore[union-attr]
    # In the key's own stream of the lane, which the lane now lists.
    assert redis_client.xlen(stream_key(settings.key_prefix, "sim", "vip", message.tenant)) == 1
    assert lane_messages(redis_client, settings.key_prefix, "sim", "normal") == []


def test_client_request_id_is_echoed(client: TestClient, auth: dict[str, str]) -> None:
    response = client.get("/v1/jobs", headers={**auth, "X-Request-ID": "abc-123"})
    assert response.headers["X-Request-ID"] == "abc-123"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "nope", "input": "x"}, 422, "model: unknown model 'nope'"),
        ({"model": "minilm", "input": 42}, 422, "input: must be a string"),
        ({"model": "minilm", "input": ""}, 422, "input: must not be empty"),
        ({"model": "minilm", "input": "   "}, 422, "input: must not be empty"),
        ({"model": "sim", "input": {"cost": "big"}}, 422, "input.cost: must be an integer"),
        ({"model": "sim", "input": {"cost": 1}, "priority": "asap"}, 422, "priority"),
        ({"model": "sim", "input": {"cost": 1}, "deadline_ms": -5}, 422, "deadline_ms"),
        ({"model": "sim", "input": {"cost": 1}, "deadline_ms": 0}, 422, "deadline_ms"),
        ({"model": "sim"}, 422, "input: is required"),
        ({"input": "x"}, 422, "model: is required"),
        ({"model": "sim", "input": {"cost": 1}, "colour": "red"}, 422, "colour: is not a known"),
        ({"model": "sim", "input": {"cost": 1}, "callback_url": "ftp://x"}, 422, "callback_url"),
    ],
)
def test_bad_input_is_refused_with_the_field_named(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    body: dict[str, Any],
    status: int,
    needle: str,
) -> None:
    response = client.post("/v1/jobs", json=body, headers=auth)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request"
    assert needle in error["message"]
    with sessions() as session:
        assert session.query(Job).count() == 0


def test_malformed_json_is_a_400(client: TestClient, auth: dict[str, str]) -> None:
    response = client.post(
        "/v1/jobs",
        content=b'{"model": "sim",',
        headers={**auth, "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_json"


def test_oversize_body_is_a_413(
    client: TestClient, auth: dict[str, str], settings: Settings
) -> None:
    text = "word " * (settings.max_body_bytes // 5 + 10)
    response = submit(client, auth, model="minilm", input=text)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "payload_too_large"
    assert str(settings.max_body_bytes) in error["message"]
    assert response.headers["X-Request-ID"]


def test_oversize_chunked_body_is_a_413(
    client: TestClient, auth: dict[str, str], settings: Settings
) -> None:
    chunk = b"x" * 4096

    def body() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for _ in range(settings.max_body_bytes // len(chunk) + 2):
            yield chunk

    response = client.post(
        "/v1/jobs", content=body(), headers={**auth, "Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "payload_too_large"


def test_small_chunked_body_is_accepted(client: TestClient, auth: dict[str, str]) -> None:
    def body() -> Iterator[bytes]:
        yield b'{"model": "sim", '
        yield b'"input": {"cost": 2}}'

    response = client.post(
        "/v1/jobs", content=body(), headers={**auth, "Content-Type": "application/json"}
    )
    assert response.status_code == 202, response.text


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "sim", "input": {"cost": 1}, "metadata": {"a": float("nan")}}, "metadata"),
        ({"model": "minilm", "input": "a\x00b"}, "input: must not contain NUL"),
        ({"model": "sim", "input": {"cost": 1}, "idempotency_key": "k\x00"}, "idempotency_key"),
        (
            {"model": "sim", "input": {"cost": 1}, "callback_url": "https://a\x00.b/"},
            "callback_url",
        ),
        ({"model": "sim", "input": {"cost": 1}, "metadata": {"k\x00": 1}}, "metadata"),
    ],
)
def test_values_the_database_cannot_store_are_a_422(
    client: TestClient, auth: dict[str, str], body: dict[str, Any], needle: str
) -> None:
    payload = json.dumps(body)  # allows NaN, as some clients do
    response = client.post(
        "/v1/jobs", content=payload, headers={**auth, "Content-Type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert needle in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "params",
    [
        {"model": "s\x00im"},
        {"cursor": "MDAwMS0wMS0wMVQwMDowMDowMCsxNDowMHx4"},  # year 1, +14:00: overflows
        {"cursor": "bm90IGEgY3Vyc29y"},
    ],
)
def test_bad_list_parameters_are_a_422(
    client: TestClient, auth: dict[str, str], params: dict[str, str]
) -> None:
    response = client.get("/v1/jobs", params=params, headers=auth)
    assert response.status_code == 422, response.text
    assert next(iter(params)) in response.json()["error"]["message"]


def test_an_unexpected_error_is_a_bare_500_with_the_request_id(
    client: TestClient, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("secret detail")

    monkeypatch.setattr(services, "list_jobs", broken)
    response = client.get("/v1/jobs", headers={**auth, "X-Request-ID": "req-42"})
    assert response.status_code == 500
    assert response.headers["X-Request-ID"] == "req-42"
    assert response.json() == {
        "error": {"type": "internal_error", "message": "internal error (request_id req-42)"}
    }
    assert "secret" not in response.text


def test_a_long_poll_holds_no_database_connection(client: TestClient, auth: dict[str, str]) -> None:
    """Waiting long-polls hold no connection: the group read's threads keep one each (two
    at most), however many requests wait."""
    jobs = [submit(client, auth, model="sim", input={"cost": 1}).json() for _ in range(6)]
    engine = app_state(client.app).engine
    polls = [
        threading.Thread(
            target=client.get,
            args=(f"/v1/jobs/{job['id']}",),
            kwargs={"params": {"wait": 2}, "headers": auth},
        )
        for job in jobs
    ]
    for poll in polls:
        poll.start()
    samples = []
    for _ in range(3):
        time.sleep(0.25)
        samples.append(engine.pool.checkedout())  # type: ignore[attr-defined]
    for poll in polls:
        poll.join(10)
    assert max(samples) <= 2, samples


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({}, "missing Authorization header"),
        ({"Authorization": "Basic abc"}, "must be: Bearer"),
        ({"Authorization": "Bearer fy_0123456789abcdef_wrong"}, "invalid or revoked"),
        ({"Authorization": "Bearer nonsense"}, "invalid or revoked"),
    ],
)
def test_missing_or_wrong_key_is_a_401(
    client: TestClient, headers: dict[str, str], needle: str
) -> None:
    for method, path in [("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/v1/models")]:
        response = client.request(method, path, headers=headers, json={"model": "sim"})
        assert response.status_code == 401, (method, path, response.text)
        assert response.json()["error"]["type"] == "unauthorized"
        assert needle in response.json()["error"]["message"]


def test_a_key_sees_only_its_own_jobs(
    client: TestClient, auth: dict[str, str], make_token: Callable[[str], str]
) -> None:
    job = submit(client, auth, model="sim", input={"cost": 1}).json()
    other = {"Authorization": f"Bearer {make_token('other')}"}
    mine = client.get(f"/v1/jobs/{job['id']}", headers=auth)
    theirs = client.get(f"/v1/jobs/{job['id']}", headers=other)
    missing = client.get("/v1/jobs/00000000-0000-4000-8000-000000000000", headers=other)
    assert mine.status_code == 200
    assert theirs.status_code == 404
    assert theirs.json()["error"]["message"].replace(job["id"], "X") == missing.json()["error"][
        "message"
    ].replace("00000000-0000-4000-8000-000000000000", "X")
    assert client.delete(f"/v1/jobs/{job['id']}", headers=other).status_code == 404
    assert client.get("/v1/jobs", headers=other).json()["data"] == []


def test_idempotency_key_returns_the_original_job(
    client: TestClient, auth: dict[str, str], redis_client: redis.Redis, settings: Settings
) -> None:
    first = submit(client, auth, model="sim", input={"cost": 3}, idempotency_key="k1")
    again = client.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 3}},
        headers={**auth, "Idempotency-Key": "k1"},
    )
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert len(lane_messages(redis_client, settings.key_prefix, "sim", "normal")) == 1
    conflict = submit(client, auth, model="sim", input={"cost": 4}, idempotency_key="k1")
    assert conflict.status_code == 409
    assert "idempotency_key" in conflict.json()["error"]["message"]


def test_cancel_a_queued_job_then_409(client: TestClient, auth: dict[str, str]) -> None:
    job = submit(client, auth, model="sim", input={"cost": 1}).json()
    cancelled = client.delete(f"/v1/jobs/{job['id']}", headers=auth)
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    again = client.delete(f"/v1/jobs/{job['id']}", headers=auth)
    assert again.status_code == 409
    assert again.json()["error"]["type"] == "conflict"
    assert "cancelled" in again.json()["error"]["message"]


def test_list_filters_and_paginates(client: TestClient, auth: dict[str, str]) -> None:
    ids = [submit(client, auth, model="sim", input={"cost": i + 1}).json()["id"] for i in range(5)]
    client.delete(f"/v1/jobs/{ids[0]}", headers=auth)
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, "model": "sim"}
        if cursor:
            params["cursor"] = cursor
        page = client.get("/v1/jobs", params=params, headers=auth).json()
        seen += [job["id"] for job in page["data"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert sorted(seen) == sorted(ids)
    assert len(seen) == len(set(seen))
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}, headers=auth).json()
    assert [job["id"] for job in cancelled["data"]] == [ids[0]]
    bad = client.get("/v1/jobs", params={"status": "done"}, headers=auth)
    assert bad.status_code == 422
    assert "status" in bad.json()["error"]["message"]
    bad_cursor = client.get("/v1/jobs", params={"cursor": "zzz"}, headers=auth)
    assert bad_cursor.status_code == 422


def test_long_poll_returns_when_the_worker_finishes(
    client: TestClient, auth: dict[str, str], sim_worker: Callable[..., RunningLoop]
) -> None:
    job = submit(client, auth, model="sim", input={"cost": 2}).json()
    with sim_worker():
        done = client.get(f"/v1/jobs/{job['id']}", params={"wait": 8}, headers=auth)
    body = done.json()
    assert body["status"] == "succeeded", body
    assert body["output"] == {"cost": 2}
    assert body["batch"]["size"] >= 1
    assert body["attempts"] == 1
    assert body["timings"]["total_ms"] >= body["timings"]["inference_ms"] > 0


def test_long_poll_times_out_with_the_current_state(
    client: TestClient, auth: dict[str, str]
) -> None:
    job = submit(client, auth, model="sim", input={"cost": 2}).json()
    response = client.get(f"/v1/jobs/{job['id']}", params={"wait": 0.3}, headers=auth)
    assert response.status_code == 200
    assert response.json()["status"] == "queued"
    too_long = client.get(f"/v1/jobs/{job['id']}", params={"wait": 1000}, headers=auth)
    assert too_long.status_code == 422
    assert "wait" in too_long.json()["error"]["message"]


def test_models_lists_the_catalog_with_queue_depth(
    client: TestClient, auth: dict[str, str]
) -> None:
    submit(client, auth, model="sim", input={"cost": 1}, priority="bulk")
    submit(client, auth, model="sim", input={"cost": 1}, priority="bulk")
    models = {m["name"]: m for m in client.get("/v1/models", headers=auth).json()["data"]}
    # The shipped tiny generation models are listed once their files are built.
    assert set(models) - {"tiny-gpt2", "tiny-llama"} == {"minilm", "resnet50", "sim"}
    assert models["sim"]["queue_depth"] == {"urgent": 0, "vip": 0, "normal": 0, "bulk": 2}
    assert models["minilm"]["input_schema"]["type"] == "string"
    assert models["sim"]["workers"] == 0


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"redis": "ok", "database": "ok"}
    assert client.get("/docs").status_code == 200
    assert "/v1/jobs" in client.get("/openapi.json").json()["paths"]


def test_openapi_documents_the_error_statuses(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    post = spec["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"202", "400", "401", "409", "413", "422", "503"} <= set(post)
    schema = post["422"]["content"]["application/json"]["schema"]["$ref"]
    assert schema.endswith("/ErrorBody")
