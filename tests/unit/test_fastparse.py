"""A route read by api.fastparse answers every request as FastAPI's own reading of the same
signature does: the same status and the same error, whatever the body, its Content-Type,
the query, the headers and the key (a key refused before or after a body refused)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from fastapi import Depends, FastAPI, Request, Response
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import ApiError, install_error_handlers
from api.fastparse import Read, parsed_by, read_request
from api.jobs.routes import SUBMIT_HEADERS, WAIT_PARAM, IdempotencyKey, Wait
from api.jobs.schemas import JobCreate


async def caller(request: Request) -> str:
    """A key as api.deps.current_key answers: 401 without one, 429 over its limits."""
    header = request.headers.get("authorization", "")
    if header == "Bearer limited":
        raise ApiError(429, "rate_limited", "over the key's rate")
    if header != "Bearer good":
        raise ApiError(401, "unauthorized", "missing or invalid key")
    return "good"


def answer(**values: Any) -> Response:
    return Response(json.dumps(values, sort_keys=True), 200, media_type="application/json")


async def submitted(
    body: JobCreate,
    key: Annotated[str, Depends(caller)],
    idempotency_key: IdempotencyKey = None,
    wait: Wait = 0,
) -> Response:
    return answer(body=body.model_dump(mode="json"), key=key, idem=idempotency_key, wait=wait)


async def polled(job_id: str, key: Annotated[str, Depends(caller)], wait: Wait = 0) -> Response:
    return answer(job_id=job_id, key=key, wait=wait)


async def submit_read(request: Request) -> Response:
    read = await read_request(
        request, caller, query=WAIT_PARAM, headers=SUBMIT_HEADERS, body=JobCreate
    )
    assert read.body is not None
    return await submitted(read.body, read.key, read.headers["idempotency-key"], read.query["wait"])


async def poll_read(request: Request) -> Response:
    read: Read[str, JobCreate] = await read_request(request, caller, query=WAIT_PARAM)
    return await polled(request.path_params["job_id"], read.key, read.query["wait"])


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    """FastAPI's reading and api.fastparse's of the same two signatures (the routes'
    parameters, as api.jobs.routes declares them), behind the app's error handlers."""
    app = FastAPI()
    install_error_handlers(app)
    app.router.add_api_route("/fastapi", submitted, methods=["POST"])
    app.router.add_api_route(
        "/parsed", submitted, methods=["POST"], route_class_override=parsed_by(submit_read)
    )
    app.router.add_api_route("/fastapi/{job_id}", polled, methods=["GET"])
    app.router.add_api_route(
        "/parsed/{job_id}", polled, methods=["GET"], route_class_override=parsed_by(poll_read)
    )
    with TestClient(app, raise_server_exceptions=True) as test_client:
        yield test_client


def both(
    client: TestClient, method: str = "POST", path: str = "", **request: Any
) -> tuple[Any, Any]:
    request.setdefault("headers", {})
    request["headers"] = {"Authorization": "Bearer good", **request["headers"]}
    if request["headers"]["Authorization"] is None:
        del request["headers"]["Authorization"]
    ours, theirs = (
        client.request(method, f"/{side}{path}", **request) for side in ("parsed", "fastapi")
    )
    return (ours.status_code, ours.json()), (theirs.status_code, theirs.json())


GOOD = {"model": "sim", "input": {"cost": 2}}
JSON = {"content-type": "application/json"}

BODY = json.dumps(GOOD).encode()


def typed(content_type: str) -> dict[str, Any]:
    return {"content": BODY, "headers": {"content-type": content_type}}


CASES: list[tuple[str, dict[str, Any]]] = [
    ("a good job", {"json": GOOD}),
    ("every field", {"json": {**GOOD, "priority": "urgent", "deadline_ms": 5000}}),
    ("a wait and a key", {"json": GOOD, "params": {"wait": "2.5"}, "headers": {"Idempotency-Key": "k"}}),  # noqa: E501
    ("the last of two waits", {"json": GOOD, "params": [("wait", "1"), ("wait", "3")]}),
    ("a negative wait", {"json": GOOD, "params": {"wait": "-1"}}),
    ("a wait that is no number", {"json": GOOD, "params": {"wait": "soon"}}),
    ("an empty wait", {"json": GOOD, "params": {"wait": ""}}),
    ("a key too long", {"json": GOOD, "headers": {"Idempotency-Key": "k" * 256}}),
    ("a key of 255", {"json": GOOD, "headers": {"Idempotency-Key": "k" * 255}}),
    ("an empty key", {"json": GOOD, "headers": {"Idempotency-Key": ""}}),
    ("no body", {"headers": JSON}),
    ("no body, no type", {}),
    ("not JSON", {"content": b"{model: sim", "headers": JSON}),
    ("JSON null", {"content": b"null", "headers": JSON}),
    ("a JSON list", {"content": b"[1, 2]", "headers": JSON}),
    ("bytes that are no text", {"content": b"\xff\xfe\xfa", "headers": JSON}),
    ("nested 5000 deep", {"content": b"[" * 5000 + b"]" * 5000, "headers": JSON}),
    ("no Content-Type", {"content": BODY}),
    ("text/plain", typed("text/plain")),
    ("a JSON suffix", typed("application/vnd.api+json")),
    ("JSON with a charset", typed("application/json; charset=utf-8")),
    ("JSON in capitals", typed("APPLICATION/JSON")),
    ("a malformed type", typed("json")),
    ("an unknown field", {"json": {**GOOD, "colour": "red"}}),
    ("no model", {"json": {"input": {}}}),
    ("a wrong priority and deadline", {"json": {**GOOD, "priority": "now", "deadline_ms": -5}}),
    ("no key", {"json": GOOD, "headers": {"Authorization": None}}),
    ("no key and bad JSON", {"content": b"{x", "headers": {**JSON, "Authorization": None}}),
    ("no key and bytes that are no text", {"content": b"\xff", "headers": {**JSON, "Authorization": None}}),  # noqa: E501
    ("no key and an invalid body", {"json": {"model": ""}, "headers": {"Authorization": None}}),
    ("a limited key and bad JSON", {"content": b"{x", "headers": {**JSON, "Authorization": "Bearer limited"}}),  # noqa: E501
    ("a limited key and a bad wait", {"json": GOOD, "params": {"wait": "x"}, "headers": {"Authorization": "Bearer limited"}}),  # noqa: E501
    ("bad JSON and a bad wait", {"content": b"{x", "headers": JSON, "params": {"wait": "x"}}),
    ("errors everywhere", {"json": {"model": ""}, "params": {"wait": "x"}, "headers": {"Idempotency-Key": "k" * 300}}),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize("request_", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_each_case_is_answered_as_fastapi_answers_it(
    client: TestClient, request_: dict[str, Any]
) -> None:
    ours, theirs = both(client, **request_)
    assert ours == theirs


POLLS: list[tuple[str, dict[str, Any]]] = [
    ("a read", {}),
    ("a long-poll", {"params": {"wait": "5"}}),
    ("a bad wait", {"params": {"wait": "-2"}}),
    ("no key", {"headers": {"Authorization": None}}),
    ("no key and a bad wait", {"params": {"wait": "x"}, "headers": {"Authorization": None}}),
    ("a body, which a read ignores", {"content": b"{x", "headers": JSON}),
]


@pytest.mark.parametrize("request_", [c[1] for c in POLLS], ids=[c[0] for c in POLLS])
def test_each_read_is_answered_as_fastapi_answers_it(
    client: TestClient, request_: dict[str, Any]
) -> None:
    ours, theirs = both(client, "GET", "/job-1", **request_)
    assert ours == theirs


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
BODIES = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["sim", "", "x" * 70]) | st.integers(),
        "input": JSON_VALUES,
        "priority": st.sampled_from(["urgent", "vip", "normal", "bulk", "later"]),
        "deadline_ms": st.integers(min_value=-10, max_value=10**9) | st.text(max_size=3),
        "metadata": JSON_VALUES,
        "callback_url": st.sampled_from(["https://example.com/hook", "ftp://x", ""]),
    },
)


@settings(max_examples=200, deadline=None)
@given(
    body=(BODIES | JSON_VALUES).map(lambda v: json.dumps(v).encode())
    | st.sampled_from([b"", b"{", b"nul", b"\xff\xfe", b'{"model": "sim"']),
    content_type=st.sampled_from(
        [None, "application/json", "text/plain", "application/x+json", "multipart/form-data"]
    ),
    auth=st.sampled_from(["Bearer good", "Bearer good", "Bearer limited", None, "Basic x"]),
    wait=st.none() | st.sampled_from(["0", "1.5", "-0.0", "1e3", "nan", "inf", "-1", "a"]),
    key=st.none() | st.text(max_size=300).filter(lambda k: k.isascii() and k.isprintable()),
)
def test_any_request_is_answered_as_fastapi_answers_it(
    client: TestClient,
    body: bytes,
    content_type: str | None,
    auth: str | None,
    wait: str | None,
    key: str | None,
) -> None:
    headers: dict[str, Any] = {"Authorization": auth}
    if content_type is not None:
        headers["content-type"] = content_type
    if key is not None:
        headers["Idempotency-Key"] = key
    request: dict[str, Any] = {"content": body, "headers": headers}
    if wait is not None:
        request["params"] = {"wait": wait}
    ours, theirs = both(client, **request)
    assert ours == theirs
