"""The API's edge (api.middleware.EdgeMiddleware) in front of a small Starlette app:
request ids, the last-resort 500, security headers, a path's error dialect, metrics."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from api.middleware import STRICT_CSP, EdgeMiddleware


def _refused(_request: Request) -> Response:
    return JSONResponse(
        {"error": {"type": "invalid_request", "message": "max_tokens: at most 64"}},
        status_code=422,
        headers={"X-Request-ID": "the-app-s-own"},
    )


def _broken(_request: Request) -> Response:
    raise RuntimeError("secret detail")


def _cached(_request: Request) -> Response:
    return Response("ok", headers={"Cache-Control": "max-age=5"})


def _app() -> Any:
    routes = [
        Route(path, endpoint, methods=["GET", "POST"])
        for path, endpoint in (
            ("/v1/jobs", _refused),
            ("/v1/completions", _refused),
            ("/v2/models/m/infer", _refused),
            ("/v1/broken", _broken),
            ("/v1/embeddings/broken", _broken),
            ("/docs", _cached),
        )
    ]
    # Where FastAPI puts a user middleware: inside the server's last-resort handler.
    return Starlette(routes=routes, middleware=[Middleware(EdgeMiddleware)])


@pytest.fixture
def client() -> TestClient:
    return TestClient(_app(), raise_server_exceptions=False)


def _requests(route: str, status: str) -> float:
    value = REGISTRY.get_sample_value(
        "ferry_http_requests_total", {"method": "POST", "route": route, "status": status}
    )
    return value or 0.0


def test_every_response_carries_one_request_id_and_the_security_headers(
    client: TestClient,
) -> None:
    answer = client.post("/v1/jobs", headers={"X-Request-ID": "req-7"})
    assert answer.status_code == 422
    assert answer.headers.get_list("x-request-id") == ["req-7"]  # the app's own replaced
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["content-security-policy"] == STRICT_CSP.decode()
    assert answer.headers["cache-control"] == "no-store"
    # Ferry's own paths keep Ferry's error shape.
    assert answer.json()["error"]["message"] == "max_tokens: at most 64"
    made = client.post("/v1/jobs", headers={"X-Request-ID": "not sane!"})
    assert len(made.headers["x-request-id"]) == 32  # a new one, not the client's


def test_the_docs_may_run_scripts_and_a_route_s_cache_control_stands(client: TestClient) -> None:
    answer = client.get("/docs")
    assert "content-security-policy" not in answer.headers
    assert answer.headers["cache-control"] == "max-age=5"


def test_errors_on_openai_and_inference_protocol_paths_speak_their_dialect(
    client: TestClient,
) -> None:
    before = _requests("/v2/models/m/infer", "400"), _requests("/v2/models/m/infer", "422")
    openai = client.post("/v1/completions")
    assert openai.status_code == 400
    assert openai.json() == {
        "error": {
            "message": "max_tokens: at most 64",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_request",
        }
    }
    assert openai.headers["content-length"] == str(len(openai.content))
    assert openai.headers["x-frame-options"] == "DENY"
    oip = client.post("/v2/models/m/infer", headers={"X-Request-ID": "req-8"})
    assert (oip.status_code, oip.json()) == (400, {"error": "max_tokens: at most 64"})
    assert oip.headers["x-request-id"] == "req-8"
    # Counted with the status the client got.
    after = _requests("/v2/models/m/infer", "400"), _requests("/v2/models/m/infer", "422")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)


def test_an_unexpected_error_is_a_bare_500_with_the_request_id_in_the_path_s_dialect(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    before = _requests("/v1/broken", "500")
    answer = client.post("/v1/broken", headers={"X-Request-ID": "req-9"})
    assert answer.status_code == 500
    assert answer.headers["x-request-id"] == "req-9"
    assert answer.headers["cache-control"] == "no-store"
    assert answer.json() == {
        "error": {"type": "internal_error", "message": "internal error (request_id req-9)"}
    }
    assert "secret" not in answer.text
    # The log has the rest, under the request id.
    (logged,) = [r for r in caplog.records if getattr(r, "request_id", None) == "req-9"]
    assert logged.exc_info is not None and "secret detail" in str(logged.exc_info[1])
    assert _requests("/v1/broken", "500") - before == 1
    openai = client.post("/v1/embeddings/broken", headers={"X-Request-ID": "req-10"})
    assert openai.status_code == 500
    assert openai.json()["error"]["type"] == "server_error"
    assert openai.json()["error"]["message"] == "internal error (request_id req-10)"
