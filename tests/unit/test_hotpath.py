"""api.hotpath serves its routes as the app's router would: the same answers (errors
through the same handlers, the last-resort 500 included), the same scope for the
handler and the edge's metrics; every other request still reaches the router; a
route it would take from another refuses to be built."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient

from api.errors import ApiError, install_error_handlers
from api.fastparse import parsed_by
from api.hotpath import HotRoute, HotRoutes
from api.middleware import EdgeMiddleware

SERVED: list[str] = []  # which way each request reached its handler


async def handled(request: Request) -> Response:
    """Answers with what a handler sees of its request, or fails as ``fail`` asks."""
    SERVED.append("router" if "fastapi_middleware_astack" in request.scope else "hot")
    fail = request.query_params.get("fail")
    if fail == "api":
        raise ApiError(409, "conflict", "refused", detail_field=1)
    if fail == "validation":
        raise RequestValidationError([{"loc": ("query", "x"), "msg": "bad", "type": "value"}])
    if fail == "http":
        raise HTTPException(418, "a teapot", headers={"X-Why": "tea"})
    if fail == "bug":
        raise RuntimeError("a bug")
    body = (await request.body()).decode()
    route = request.scope["route"]
    return Response(
        json.dumps(
            {
                "route": route.path,
                "endpoint": request.scope["endpoint"].__name__,
                "params": request.path_params,
                "body": body,
                "method": request.method,
            },
            sort_keys=True,
        ),
        201,
        {"X-Handler": "yes"},
        "application/json",
    )


async def documented(job_id: str = "") -> None:
    """The endpoint FastAPI documents; ``handled`` serves it."""


async def listed() -> dict[str, str]:
    return {"served": "router"}


def _app(hot: bool) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.router.add_api_route(
        "/v1/things", documented, methods=["POST"], route_class_override=parsed_by(handled)
    )
    app.router.add_api_route("/v1/things", listed, methods=["GET"])
    app.router.add_api_route(
        "/v1/things/{job_id}",
        documented,
        methods=["GET"],
        route_class_override=parsed_by(handled),
    )
    app.router.add_api_route("/v1/things/{job_id}/more", listed, methods=["GET"])
    if hot:
        app.add_middleware(
            HotRoutes,
            owner=app,
            routes=(
                HotRoute("POST", "/v1/things", handled),
                HotRoute("GET", "/v1/things/{job_id}", handled),
            ),
        )
    app.add_middleware(EdgeMiddleware)
    return app


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[TestClient, TestClient]]:
    with (
        TestClient(_app(hot=True), raise_server_exceptions=False) as hot,
        TestClient(_app(hot=False), raise_server_exceptions=False) as plain,
    ):
        yield hot, plain


def _seen(response: Any) -> tuple[int, dict[str, str], str]:
    headers = {k: v for k, v in response.headers.items() if k != "x-request-id"}
    text = response.text.replace(response.headers.get("x-request-id", "-"), "<id>")
    return response.status_code, headers, text


# (method, path, request arguments, whether the middleware serves it)
REQUESTS = [
    ("POST", "/v1/things", {"content": b'{"a": 1}'}, True),
    ("POST", "/v1/things?fail=api", {}, True),
    ("POST", "/v1/things?fail=validation", {}, True),
    ("POST", "/v1/things?fail=http", {}, True),
    ("POST", "/v1/things?fail=bug", {}, True),
    ("GET", "/v1/things/3f6c2a", {}, True),
    ("GET", "/v1/things/a%20b?wait=1", {}, True),
    ("GET", "/v1/things/x?fail=api", {}, True),
    ("GET", "/v1/things/x?fail=bug", {}, True),
    # Another method, a deeper path, a trailing slash: the router's.
    ("GET", "/v1/things", {}, False),
    ("GET", "/v1/things/x/more", {}, False),
    ("POST", "/v1/things/", {"content": b"{}"}, False),
    ("DELETE", "/v1/things/x", {}, False),
    ("HEAD", "/v1/things/x", {}, False),
    ("GET", "/v1/things/a%2Fb", {}, False),  # the path as decoded: two segments
]


@pytest.mark.parametrize(("method", "path", "extra", "served"), REQUESTS)
def test_answers_as_the_router_does(
    clients: tuple[TestClient, TestClient],
    method: str,
    path: str,
    extra: dict[str, Any],
    served: bool,
) -> None:
    hot, plain = clients
    SERVED.clear()
    got = hot.request(method, path, follow_redirects=False, **extra)
    way = list(SERVED)
    SERVED.clear()
    expected = plain.request(method, path, follow_redirects=False, **extra)
    assert SERVED in ([], ["router"])
    assert _seen(got) == _seen(expected)
    assert way == (["hot"] if served else SERVED)


def test_a_served_answer_carries_the_route(clients: tuple[TestClient, TestClient]) -> None:
    hot, _ = clients
    answer = hot.get("/v1/things/a%20b")
    assert answer.status_code == 201
    assert answer.json() == {
        "body": "",
        "endpoint": "documented",
        "method": "GET",
        "params": {"job_id": "a b"},
        "route": "/v1/things/{job_id}",
    }
    assert answer.headers["x-request-id"]
    assert answer.headers["x-content-type-options"] == "nosniff"


def test_a_route_tried_first_keeps_its_paths() -> None:
    app = FastAPI()
    app.router.add_api_route("/v1/things/latest", listed, methods=["GET"])
    app.router.add_api_route(
        "/v1/things/{job_id}", documented, methods=["GET"], route_class_override=parsed_by(handled)
    )
    app.add_middleware(
        HotRoutes, owner=app, routes=(HotRoute("GET", "/v1/things/{job_id}", handled),)
    )
    with pytest.raises(ValueError, match="tried before it"):
        app.build_middleware_stack()
    # Another method before it takes nothing of its.
    other = FastAPI()
    other.router.add_api_route("/v1/things/latest", listed, methods=["POST"])
    other.router.add_api_route("/v1/things/{job_id}", documented, methods=["GET"])
    other.add_middleware(
        HotRoutes, owner=other, routes=(HotRoute("GET", "/v1/things/{job_id}", handled),)
    )
    other.build_middleware_stack()
    with pytest.raises(LookupError):
        HotRoutes(other, other, (HotRoute("PUT", "/v1/things/{job_id}", handled),))
