"""The catalogue of bad input for POST /v1/jobs and the job paths: each gets its status and a
message naming the field and why; nothing is stored; hostile strings are stored verbatim."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.db.schema import Job

JSON = {"Content-Type": "application/json"}
OK = {"model": "sim", "input": {"cost": 1}}


def _with(**fields: Any) -> dict[str, Any]:
    return {**OK, **fields}


@pytest.mark.parametrize(
    ("name", "request_kwargs", "status", "needle"),
    [
        (
            "text content type",
            {
                "content": b'{"model":"sim","input":{"cost":1}}',
                "headers": {"Content-Type": "text/plain"},
            },
            415,
            "Content-Type must be application/json (got 'text/plain')",
        ),
        (
            "no content type",
            {"content": b'{"model":"sim","input":{"cost":1}}'},
            415,
            "Content-Type must be application/json",
        ),
        (
            "not UTF-8",
            {
                "content": b'{"model":"sim","input":{"cost":1},"metadata":{"a":"\xff"}}',
                "headers": JSON,
            },
            400,
            "not valid JSON",
        ),
        (
            "nested 5000 deep",
            {
                "content": b'{"model":"sim","input":' + b"[" * 5000 + b"]" * 5000 + b"}",
                "headers": JSON,
            },
            400,
            "nested too deeply",
        ),
        ("a JSON array", {"json": [OK]}, 422, "body:"),
        ("model a number", {"json": _with(model=5)}, 422, "model: Input should be a valid string"),
        ("model empty", {"json": _with(model="")}, 422, "model: String should have at least 1"),
        (
            "model too long",
            {"json": _with(model="m" * 65)},
            422,
            "model: String should have at most 64",
        ),
        (
            "priority a number",
            {"json": _with(priority=1)},
            422,
            "priority: Input should be 'urgent'",
        ),
        (
            "deadline a string",
            {"json": _with(deadline_ms="soon")},
            422,
            "deadline_ms: Input should be a valid integer",
        ),
        (
            "deadline fractional",
            {"json": _with(deadline_ms=1.5)},
            422,
            "deadline_ms: Input should be a valid integer",
        ),
        (
            "deadline too far",
            {"json": _with(deadline_ms=10**20)},
            422,
            "deadline_ms: Input should be less than or equal to 604800000",
        ),
        (
            "on_deadline unknown",
            {"json": _with(deadline_ms=100, on_deadline="shrug")},
            422,
            "on_deadline: Input should be 'refuse' or 'truncate'",
        ),
        (
            "on_deadline truncate for a model that does not generate",
            {"json": _with(deadline_ms=100, on_deadline="truncate")},
            422,
            "on_deadline: truncate applies to generation jobs only",
        ),
        (
            "metadata a list",
            {"json": _with(metadata=[1])},
            422,
            "metadata: Input should be a valid dictionary",
        ),
        (
            "metadata too big",
            {"json": _with(metadata={"a": "x" * 20_000})},
            422,
            "metadata: must be at most 16384 bytes",
        ),
        (
            "idempotency key empty",
            {"json": _with(idempotency_key="")},
            422,
            "idempotency_key: String should have at least 1",
        ),
        (
            "idempotency key long",
            {"json": _with(idempotency_key="k" * 256)},
            422,
            "idempotency_key: String should have at most 255",
        ),
        (
            "callback a number",
            {"json": _with(callback_url=5)},
            422,
            "callback_url: Input should be a valid string",
        ),
        (
            "minilm text too long",
            {"json": {"model": "minilm", "input": "a" * 20_001}},
            422,
            "input: is 20001 characters; the limit is 20000",
        ),
        (
            "sim cost zero",
            {"json": {"model": "sim", "input": {"cost": 0}}},
            422,
            "input.cost: must be between 1 and 4096",
        ),
        (
            "sim cost huge",
            {"json": {"model": "sim", "input": {"cost": 10**9}}},
            422,
            "input.cost: must be between 1 and 4096",
        ),
    ],
)
def test_bad_input_gets_its_status_and_reason_and_stores_nothing(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    name: str,
    request_kwargs: dict[str, Any],
    status: int,
    needle: str,
) -> None:
    kwargs = dict(request_kwargs)  # the parameters are shared by every database's run
    headers = {**auth, **kwargs.pop("headers", {})}
    response = client.post("/v1/jobs", headers=headers, **kwargs)
    assert response.status_code == status, (name, response.text)
    assert needle in response.json()["error"]["message"], (name, response.text)
    with sessions() as session:
        assert session.query(Job).count() == 0


@pytest.mark.parametrize(
    ("query", "needle"),
    [("wait=-1", "wait: Input should be greater than or equal to 0"),
     ("wait=31", "wait: at most 10 seconds"), ("wait=1e400", "wait: at most 10 seconds"),
     ("wait=abc", "wait: Input should be a valid number")],
)  # fmt: skip
def test_wait_out_of_range_is_a_422(  # these tests' FERRY_MAX_WAIT_S is 10
    client: TestClient, auth: dict[str, str], query: str, needle: str
) -> None:
    job = client.post("/v1/jobs", json=OK, headers=auth).json()
    response = client.get(f"/v1/jobs/{job['id']}?{query}", headers=auth)
    assert response.status_code == 422
    assert needle in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "path",
    ["/v1/jobs/not-a-uuid", "/v1/jobs/1;DROP TABLE jobs", "/v1/jobs/..%2F..%2Fetc",
     "/v1/jobs/xyz/deliveries", "/v1/backfills/xyz", "/v1/backfills/xyz/results"],
)  # fmt: skip
def test_ids_that_are_not_uuids_are_not_found(
    client: TestClient, auth: dict[str, str], path: str
) -> None:
    response = client.get(path, headers=auth)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"


HOSTILE = "'; DROP TABLE jobs; -- $(rm -rf /) `id` | && %s %n {{7*7}} <script>\u202e"


def test_sql_and_shell_metacharacters_are_stored_and_returned_verbatim(
    client: TestClient, auth: dict[str, str]
) -> None:
    body = _with(metadata={HOSTILE: HOSTILE, "nested": [HOSTILE]}, idempotency_key=HOSTILE)
    created = client.post("/v1/jobs", json=body, headers=auth)
    assert created.status_code == 202, created.text
    again = client.get(f"/v1/jobs/{created.json()['id']}", headers=auth).json()
    assert again["metadata"] == {HOSTILE: HOSTILE, "nested": [HOSTILE]}
    # The same hostile idempotency key finds the same job: it was compared, not interpreted.
    replay = client.post("/v1/jobs", json=body, headers=auth)
    assert replay.json()["id"] == created.json()["id"]
    assert len(client.get("/v1/jobs", headers=auth).json()["data"]) == 1


def _nested(depth: int) -> Any:
    """``depth`` arrays, one inside the other, a number in the innermost."""
    value: Any = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


def test_nesting_past_the_limit_is_refused_and_what_fits_reads_back(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    # {"a": [[...]]}: the object is one level, so 63 arrays inside it is the most that fits.
    too_deep = client.post("/v1/jobs", json=_with(metadata={"a": _nested(64)}), headers=auth)
    assert too_deep.status_code == 422
    assert "metadata: must not contain more than 64 levels of nesting" in too_deep.text
    with sessions() as session:
        assert session.query(Job).count() == 0
    fits = client.post("/v1/jobs", json=_with(metadata={"a": _nested(63)}), headers=auth)
    assert fits.status_code == 202, fits.text
    # Stored, and written back out: one job, one list, both readable.
    assert client.get(f"/v1/jobs/{fits.json()['id']}", headers=auth).status_code == 200
    assert client.get("/v1/jobs", headers=auth).status_code == 200


def test_a_backfill_line_nested_too_deep_is_refused_with_its_line(
    client: TestClient, auth: dict[str, str]
) -> None:
    first = b'{"custom_id": "ok", "input": {"cost": 1}}\n'
    # 80 levels: parsed, then refused; 5,000: more than the JSON parser itself will nest.
    for depth, why in ((80, "levels of nesting"), (5000, "nested too deeply")):
        nested = "[" * depth + "]" * depth  # written by hand: json.dumps cannot go so deep
        deep = '{"custom_id": "deep", "input": {"cost": 1, "x": ' + nested + "}}"
        body = first + deep.encode() + b"\n"
        response = client.post("/v1/backfills", params={"model": "sim"}, content=body, headers=auth)
        assert response.status_code == 422, response.text
        assert "line 2" in response.json()["error"]["message"]
        assert why in response.json()["error"]["message"]
        assert client.get("/v1/backfills", headers=auth).json()["data"] == []


def test_lowered_metadata_and_nesting_limits_are_enforced_before_anything_is_stored(
    settings: Settings, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    strict = settings.model_copy(update={"max_metadata_bytes": 100, "max_json_depth": 4})
    with TestClient(create_app(strict)) as client:
        refused = {
            "metadata: must be at most 100 bytes of JSON": _with(metadata={"k": "x" * 100}),
            "input: must not contain more than 4 levels of nesting": _with(
                input={"cost": 1, "x": _nested(4)}
            ),
            "metadata: must not contain more than 4 levels of nesting": _with(
                metadata={"a": _nested(4)}
            ),
        }
        for needle, body in refused.items():
            response = client.post("/v1/jobs", json=body, headers=auth)
            assert response.status_code == 422, response.text
            assert needle in response.json()["error"]["message"]
        line = json.dumps({"custom_id": "deep", "input": {"cost": 1, "x": _nested(4)}})
        response = client.post(
            "/v1/backfills", params={"model": "sim"}, content=line.encode(), headers=auth
        )
        assert response.status_code == 422, response.text
        assert "line 1: input: must not contain more than 4 levels" in response.text
        with sessions() as session:
            assert session.query(Job).count() == 0
        # Just inside both limits: accepted.
        for metadata in ({"k": "x" * 92}, {"a": _nested(3)}):  # 100 bytes; 4 levels
            fits = client.post("/v1/jobs", json=_with(metadata=metadata), headers=auth)
            assert fits.status_code == 202, fits.text
