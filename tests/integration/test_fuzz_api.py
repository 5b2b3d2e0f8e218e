"""Property-based fuzzing of the whole HTTP API from its own OpenAPI document (schemathesis):
no 5xx, and every response matches the schema (status documented, body conforming).

Bounded: FERRY_FUZZ_EXAMPLES cases per operation (default 25), so CI stays fast.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from api.app import create_app
from core import migrate
from core.db import make_engine, make_sessionmaker
from core.keys import create_key
from core.settings import Settings


@schemathesis.serializer("application/x-ndjson")
def _ndjson(_ctx: Any, value: Any) -> bytes:
    """Backfill uploads: whatever bytes the fuzzer makes, sent as they are."""
    return value if isinstance(value, bytes) else str(value).encode()


# The document the running API serves (no connection is made to build it).
SCHEMA = schemathesis.openapi.from_dict(
    create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi()
)
EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "25"))


@pytest.fixture
def fuzzed(redis_url: str, key_prefix: str, tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    """The API on SQLite (the database tests cover PostgreSQL) and a key of its own."""
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, data_dir=tmp_path)
    migrate.upgrade(settings.sqlalchemy_url)
    engine = make_engine(settings.sqlalchemy_url)
    with make_sessionmaker(engine)() as session:
        token = create_key(session, "fuzz").token
    engine.dispose()
    with TestClient(create_app(settings)) as client:
        yield client, token


@SCHEMA.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_input_makes_the_api_fail_or_break_its_schema(
    case: Any, fuzzed: tuple[TestClient, str]
) -> None:
    client, token = fuzzed
    kwargs = case.as_transport_kwargs(
        base_url="http://testserver", headers={"Authorization": f"Bearer {token}"}
    )
    request: dict[str, Any] = {
        "method": kwargs["method"],
        "url": kwargs["url"],
        "headers": kwargs.get("headers"),
        "params": kwargs.get("params"),
    }
    if "json" in kwargs:
        request["json"] = kwargs["json"]
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        request["content"] = data.encode() if isinstance(data, str) else data
    response = client.request(**request)
    assert response.status_code < 500, (case.method, case.path, response.text)
    case.validate_response(
        response,
        headers=kwargs.get("headers"),
        transport_kwargs=kwargs,
        # Rules the schema cannot state (an empty callback URL, a model's own input schema)
        # refuse some schema-valid requests with a 422; that is correct, not a failure.
        excluded_checks=[positive_data_acceptance],
    )
