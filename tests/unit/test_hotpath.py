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


def test_an_included_router_is_served_under_its_prefix() -> None:
    """The route as the router serves it: an include's prefix in its path (and a route
    under another included router, tried before, that would take its paths refuses)."""
    from fastapi import APIRouter

    things = APIRouter(prefix="/v1/things")
    things.add_api_route(
        "/{job_id}", documented, methods=["GET"], route_class_override=parsed_by(handled)
    )
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(things, prefix="/api")
    app.add_middleware(
        HotRoutes, owner=app, routes=(HotRoute("GET", "/api/v1/things/{job_id}", handled),)
    )
    with TestClient(app) as client:
        SERVED.clear()
        answer = client.get("/api/v1/things/7")
        assert (answer.status_code, SERVED) == (201, ["hot"])
        assert answer.json()["params"] == {"job_id": "7"}
        SERVED.clear()
        assert client.get("/v1/things/7").status_code == 404
        assert SERVED == []

    other = APIRouter()
    other.add_api_route("/{kind}/{n:int}", listed, methods=["GET"])
    crowded = FastAPI()
    crowded.include_router(other, prefix="/api/v1")
    crowded.include_router(things, prefix="/api")
    crowded.add_middleware(
        HotRoutes, owner=crowded, routes=(HotRoute("GET", "/api/v1/things/{job_id}", handled),)
    )
    with pytest.raises(ValueError, match="tried before it"):
        crowded.build_middleware_stack()


@pytest.mark.parametrize(
    ("before", "method", "served"),
    [
        ("/v1/{kind}/{n:int}", "GET", "/v1/things/{job_id}"),  # both with parameters
        ("/v1/{kind}", "POST", "/v1/things"),  # its pattern takes the served one's path
        ("/v1/things/latest", "GET", "/v1/things/{job_id}"),  # its one path is the served's
    ],
)
def test_a_route_tried_first_that_may_take_its_paths_refuses(
    before: str, method: str, served: str
) -> None:
    app = FastAPI()
    app.router.add_api_route(before, listed, methods=[method])
    app.router.add_api_route(
        served, documented, methods=[method], route_class_override=parsed_by(handled)
    )
    app.add_middleware(HotRoutes, owner=app, routes=(HotRoute(method, served, handled),))
    with pytest.raises(ValueError, match="tried before it"):
        app.build_middleware_stack()


def test_a_routes_body_limit_holds() -> None:
    """A route's own body limit, which the router puts around its handler, is kept."""
    apps = []
    for hot in (True, False):
        app = FastAPI()
        install_error_handlers(app)
        app.router.add_api_route(
            "/v1/things",
            documented,
            methods=["POST"],
            route_class_override=parsed_by(handled),
            max_body_size=10,
        )
        if hot:
            app.add_middleware(
                HotRoutes, owner=app, routes=(HotRoute("POST", "/v1/things", handled),)
            )
        apps.append(app)
    answers = []
    for app in apps:
        with TestClient(app) as client:
            SERVED.clear()
            small, large = (
                client.post("/v1/things", content=b"{}"),
                client.post("/v1/things", content=b"x" * 100),
            )
            answers.append((small.status_code, large.status_code, large.text, list(SERVED)))
    assert answers[0][:3] == answers[1][:3] == (201, 413, answers[1][2])
    # (The limit holds as the handler reads the body: both requests reach it, each way.)
    assert (answers[0][3], answers[1][3]) == (["hot", "hot"], ["router", "router"])


def test_the_app_serves_the_job_routes_so(tmp_path: Any) -> None:
    """The API's app puts the middleware innermost, with the two job routes."""
    from api.app import create_app
    from api.jobs import routes as jobs
    from core.config.settings import Settings

    # Never connected to: building the app talks to nothing.
    app = create_app(Settings(redis_url="redis://127.0.0.1:9/0", data_dir=tmp_path, models="sim"))
    layer: Any = app.build_middleware_stack()
    found = []
    while layer is not None:
        if isinstance(layer, HotRoutes):
            found.append(layer)
        layer = getattr(layer, "app", None)
    assert len(found) == 1
    served = {(method, s.route.path) for method, all_ in found[0]._served.items() for s in all_}
    assert served == {(hot.method, hot.path) for hot in jobs.HOT}
    assert served == {("POST", "/v1/jobs"), ("GET", "/v1/jobs/{job_id}")}
