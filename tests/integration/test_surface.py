"""The API's surface: security headers on every response, CORS only where configured."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr, ValidationError

from api.app import create_app
from core.config.settings import Settings

ORIGIN = "https://app.example.com"
STRICT_CSP = "default-src 'none'; frame-ancestors 'none'"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/healthz", 200), ("GET", "/v1/jobs", 401), ("GET", "/nothing", 404),
     ("POST", "/v1/jobs", 401)],
)  # fmt: skip
def test_every_response_carries_the_security_headers(
    client: TestClient, method: str, path: str, status: int
) -> None:
    response = client.request(method, path)
    assert response.status_code == status
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["referrer-policy"] == "no-referrer"
    assert response.headers["content-security-policy"] == STRICT_CSP
    assert response.headers["cache-control"] == "no-store"
    assert "access-control-allow-origin" not in response.headers


def test_an_oversized_body_is_refused_with_the_headers_too(client: TestClient) -> None:
    response = client.post(
        "/v1/jobs", content=b"x" * (128 * 1024), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert response.headers["x-content-type-options"] == "nosniff"


def test_the_docs_page_may_run_its_scripts(client: TestClient) -> None:
    response = client.get("/docs")
    assert response.status_code == 200
    assert "content-security-policy" not in response.headers
    assert response.headers["x-frame-options"] == "DENY"


def test_without_configured_origins_there_is_no_cors(client: TestClient) -> None:
    preflight = client.options(
        "/v1/jobs",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    plain = client.get("/healthz", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in plain.headers


@pytest.fixture
def cors_client(settings: Settings) -> Iterator[TestClient]:
    configured = settings.model_copy(update={"cors_origins": [ORIGIN]})
    with TestClient(create_app(configured)) as test_client:
        yield test_client


def test_configured_origins_and_only_they_get_cors(cors_client: TestClient) -> None:
    preflight = cors_client.options(
        "/v1/jobs",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"},
    )  # fmt: skip
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    # The preflight CORS answers itself still carries the request id and the headers.
    assert preflight.headers["x-request-id"]
    assert preflight.headers["x-content-type-options"] == "nosniff"
    assert preflight.headers["content-security-policy"] == STRICT_CSP
    other = cors_client.options(
        "/v1/jobs",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"
    response = cors_client.get("/healthz", headers={"Origin": ORIGIN})
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in response.headers["access-control-expose-headers"].lower()


def test_origins_are_read_from_a_json_list_or_a_comma_separated_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for text in (f'["{ORIGIN}", "http://localhost:3000"]', f"{ORIGIN}, http://localhost:3000"):
        monkeypatch.setenv("FERRY_CORS_ORIGINS", text)
        assert Settings().cors_origins == [ORIGIN, "http://localhost:3000"]
    monkeypatch.setenv("FERRY_CORS_ORIGINS", "")
    assert Settings().cors_origins == []
    monkeypatch.setenv("FERRY_CORS_ORIGINS", "app.example.com")
    with pytest.raises(ValidationError, match="is not an origin"):
        Settings()


@pytest.mark.parametrize("origin", ["app.example.com", "https://a.example/path", "ftp://x"])
def test_an_origin_that_is_not_one_is_refused(origin: str) -> None:
    with pytest.raises(ValidationError, match="is not an origin"):
        Settings(cors_origins=[origin])


def test_a_wrong_method_names_every_method_the_path_has(client: TestClient) -> None:
    response = client.request("PUT", "/v1/jobs")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, POST"
    assert response.json()["error"]["message"] == (
        "method PUT not allowed here (allowed: GET, POST)"
    )


def test_with_a_metrics_token_the_apis_metrics_ask_for_it(settings: Settings) -> None:
    configured = settings.model_copy(update={"metrics_token": SecretStr("s3cret")})
    with TestClient(create_app(configured)) as locked:
        refused = locked.get("/metrics")
        assert refused.status_code == 401
        assert refused.json()["error"]["message"] == "metrics token required"
        assert locked.get("/metrics", headers={"Authorization": "Bearer no"}).status_code == 401
        scraped = locked.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert scraped.status_code == 200 and "ferry_queue_depth" in scraped.text
        assert locked.get("/healthz").status_code == 200


def test_a_wrong_method_on_the_docs_still_names_the_allowed_one(client: TestClient) -> None:
    response = client.post("/openapi.json")
    assert response.status_code == 405
    assert "GET" in response.headers["allow"].split(", ")
