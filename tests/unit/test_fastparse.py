"""A route read by api.fastparse answers every request as FastAPI's own reading of the same
signature does: the same status and the same error, whatever the body, its Content-Type,
the query and the headers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from fastapi import FastAPI, Header, Query, Request, Response
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import install_error_handlers
from api.fastparse import header_value, json_body, parsed_by, query_value, raise_if
from api.jobs.routes import IDEMPOTENCY_KEY, WAIT
from api.jobs.schemas import JobCreate


async def echo(
    body: JobCreate,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
    wait: Annotated[float, Query(ge=0)] = 0,
) -> Response:
    answer = {"body": body.model_dump(mode="json"), "key": idempotency_key, "wait": wait}
    return Response(json.dumps(answer, sort_keys=True), 200, media_type="application/json")


async def parsed(request: Request) -> Response:
    wait, errors = query_value(request, "wait", WAIT, 0.0)
    key, header_errors = header_value(request, "idempotency-key", IDEMPOTENCY_KEY, None)
    body, body_errors = await json_body(request, JobCreate)
    raise_if(errors + header_errors + body_errors)
    assert body is not None
    return await echo(body, key, wait)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = FastAPI()
    install_error_handlers(app)
    app.router.add_api_route("/fastapi", echo, methods=["POST"])
    app.router.add_api_route(
        "/parsed", echo, methods=["POST"], route_class_override=parsed_by(parsed)
    )
    with TestClient(app, raise_server_exceptions=True) as test_client:
        yield test_client


def both(client: TestClient, **request: Any) -> tuple[Any, Any]:
    ours, theirs = (client.post(path, **request) for path in ("/parsed", "/fastapi"))
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
    ("errors everywhere", {"json": {"model": ""}, "params": {"wait": "x"}, "headers": {"Idempotency-Key": "k" * 300}}),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize("request_", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_each_case_is_answered_as_fastapi_answers_it(
    client: TestClient, request_: dict[str, Any]
) -> None:
    ours, theirs = both(client, **request_)
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


@settings(max_examples=150, deadline=None)
@given(
    body=BODIES | JSON_VALUES,
    wait=st.none() | st.sampled_from(["0", "1.5", "-0.0", "1e3", "nan", "inf", "-1", "a"]),
    key=st.none() | st.text(max_size=300).filter(lambda k: k.isascii() and k.isprintable()),
)
def test_any_body_query_and_key_is_answered_as_fastapi_answers_it(
    client: TestClient, body: Any, wait: str | None, key: str | None
) -> None:
    request: dict[str, Any] = {"content": json.dumps(body).encode(), "headers": dict(JSON)}
    if wait is not None:
        request["params"] = {"wait": wait}
    if key is not None:
        request["headers"]["Idempotency-Key"] = key
    ours, theirs = both(client, **request)
    assert ours == theirs
