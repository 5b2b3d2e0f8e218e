"""Property-based fuzzing of the whole HTTP API from its own OpenAPI document (schemathesis):
no 5xx, and every response matches the schema (status documented, body conforming).

Bounded: FERRY_FUZZ_EXAMPLES cases per operation (default 25), so CI stays fast. A client
key fuzzes every operation; an admin key the operations only it may call (the ones that
document a 403), which a client key never gets past.

Each run draws a fresh seed unless FERRY_FUZZ_SEED names one; the seed is in every
failure's message and in the JUnit XML (property ``fuzz_seed``), and
``FERRY_FUZZ_SEED=<seed>`` makes the same cases again.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from api.app import create_app
from core.config.settings import Settings
from core.db import migrate
from core.db.keys import create_key
from core.db.schema import make_engine, make_sessionmaker


@schemathesis.serializer("application/x-ndjson")
def _ndjson(_ctx: Any, value: Any) -> bytes:
    """Backfill uploads: whatever bytes the fuzzer makes, sent as they are."""
    return value if isinstance(value, bytes) else str(value).encode()


# The document the running API serves (no connection is made to build it).
SCHEMA = schemathesis.openapi.from_dict(
    create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi()
)
EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "25"))
SEED = int(os.environ.get("FERRY_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
# Each operation's cases follow from this seed and its name alone (schemathesis derives a
# seed per operation), so one seed replays any failing test of this run.
SCHEMA.config.seed = SEED
ADMIN_ONLY = SCHEMA.include(lambda ctx: "403" in ctx.operation.definition.raw["responses"])
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=False,
    # No examples saved between runs: a failure comes back from its seed, not from a file.
    database=None,
)

Fuzzed = tuple[TestClient, str]


@contextmanager
def _api(
    scope: str, tmp_path: Path, redis_url: str, key_prefix: str, record: Callable[..., None]
) -> Iterator[Fuzzed]:
    """The API on SQLite (the database tests cover PostgreSQL) and a key of its own."""
    record("fuzz_seed", SEED)
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, data_dir=tmp_path)
    migrate.upgrade(settings.sqlalchemy_url)
    engine = make_engine(settings.sqlalchemy_url)
    with make_sessionmaker(engine)() as session:
        token = create_key(session, f"fuzz-{scope}", scope=scope).token
    engine.dispose()
    with TestClient(create_app(settings)) as client:
        yield client, token


@pytest.fixture
def client_key_api(
    redis_url: str, key_prefix: str, tmp_path: Path, record_property: Callable[..., None]
) -> Iterator[Fuzzed]:
    with _api("client", tmp_path, redis_url, key_prefix, record_property) as api:
        yield api


@pytest.fixture
def admin_key_api(
    redis_url: str, key_prefix: str, tmp_path: Path, record_property: Callable[..., None]
) -> Iterator[Fuzzed]:
    with _api("admin", tmp_path, redis_url, key_prefix, record_property) as api:
        yield api


@SCHEMA.parametrize()
@FUZZ_SETTINGS
def test_no_input_makes_the_api_fail_or_break_its_schema(case: Any, client_key_api: Fuzzed) -> None:
    _fuzz(case, *client_key_api)


@ADMIN_ONLY.parametrize()
@FUZZ_SETTINGS
def test_no_input_makes_an_admin_operation_fail_or_break_its_schema(
    case: Any, admin_key_api: Fuzzed
) -> None:
    _fuzz(case, *admin_key_api)


def _fuzz(case: Any, client: TestClient, token: str) -> None:
    try:
        _send_and_check(case, client, token)
    except Exception as exc:
        exc.add_note(f"replay these cases with FERRY_FUZZ_SEED={SEED}")
        raise


def _send_and_check(case: Any, client: TestClient, token: str) -> None:
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
