"""The Python client on its own: what it depends on, its retry rule, errors, webhook checks."""

from __future__ import annotations

import ast
import datetime as dt
import json
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from ferry_client import Retries, WebhookVerificationError, verify_webhook
from ferry_client.errors import BadRequest, RateLimited, Unavailable, error_for
from standardwebhooks import Webhook

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "python"


def test_the_client_needs_nothing_but_httpx_and_pydantic() -> None:
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert sorted(dep.split(">")[0] for dep in project["dependencies"]) == ["httpx", "pydantic"]
    allowed = set(sys.stdlib_module_names) | {"httpx", "pydantic", "ferry_client"}
    for path in (PACKAGE / "ferry_client").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def answer(status: int, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, headers=headers or {})


@pytest.mark.parametrize(
    ("response", "safe", "retried"),
    [
        (answer(429, {"Retry-After": "1"}), False, True),  # refused before anything was done
        (answer(503, {"Retry-After": "2"}), True, True),
        (answer(503), False, False),  # a submission without a key might have been stored
        (answer(502), True, True),
        (answer(504), True, True),
        (answer(500), True, False),
        (answer(422), True, False),
        (None, True, True),  # no answer: repeat what is safe to repeat
        (None, False, False),
    ],
)
def test_what_is_retried(response: httpx.Response | None, safe: bool, retried: bool) -> None:
    assert Retries().should_retry(1, response, safe) is retried


def test_retries_stop_after_the_last_one() -> None:
    retries = Retries(max_retries=2)
    assert retries.should_retry(2, answer(503), True)
    assert not retries.should_retry(3, answer(503), True)


def test_retry_after_is_honoured_up_to_its_cap_and_backoff_grows_otherwise() -> None:
    retries = Retries(base_s=0.5, max_backoff_s=8.0, max_retry_after_s=60.0)
    assert retries.delay_s(1, answer(503, {"Retry-After": "2"})) == 2.0
    assert retries.delay_s(1, answer(429, {"Retry-After": "3600"})) == 60.0
    future = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)
    date = future.strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert 25.0 <= retries.delay_s(1, answer(503, {"Retry-After": date})) <= 30.0
    for attempt, cap in ((1, 0.5), (3, 2.0), (10, 8.0)):
        assert all(0 <= retries.delay_s(attempt, None) <= cap for _ in range(50))


def test_errors_carry_the_apis_type_and_fields() -> None:
    body = {"error": {"type": "invalid_request", "message": "input.cost: too big", "field": "x"}}
    error = error_for(422, body, "req-1")
    assert isinstance(error, BadRequest)
    assert (error.status, error.type, error.message) == (
        422,
        "invalid_request",
        body["error"]["message"],
    )
    assert error.request_id == "req-1" and error.details == {"field": "x"}
    assert isinstance(error_for(429, {"error": {"type": "rate_limited"}}, None), RateLimited)
    assert isinstance(error_for(503, "<html>proxy</html>", None), Unavailable)


SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def signed(body: str, at: dt.datetime, secret: str = SECRET) -> dict[str, str]:
    """Headers as Ferry's sender makes them (the Standard Webhooks library)."""
    return {
        "Webhook-Id": "msg_1",
        "Webhook-Timestamp": str(int(at.timestamp())),
        "Webhook-Signature": Webhook(secret).sign("msg_1", at, body),
    }


def test_a_delivery_signed_by_the_secret_verifies_and_a_forged_one_does_not() -> None:
    body = json.dumps({"type": "job.succeeded", "data": {"id": "j1"}})
    now = dt.datetime.now(dt.UTC)
    assert verify_webhook(signed(body, now), body.encode(), SECRET)["data"]["id"] == "j1"
    with pytest.raises(WebhookVerificationError, match="no signature"):
        verify_webhook(signed(body, now), body.replace("j1", "j2"), SECRET)
    other = "whsec_" + "A" * 32
    with pytest.raises(WebhookVerificationError, match="no signature"):
        verify_webhook(signed(body, now, other), body, SECRET)
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify_webhook(signed(body, now - dt.timedelta(minutes=10)), body, SECRET)
    with pytest.raises(WebhookVerificationError, match="missing header"):
        verify_webhook({}, body, SECRET)


def test_during_a_rotation_either_secret_verifies() -> None:
    body = '{"type":"job.failed","data":{}}'
    now = dt.datetime.now(dt.UTC)
    new = "whsec_" + "B" * 32
    both = signed(body, now, new)
    both["Webhook-Signature"] += " " + Webhook(SECRET).sign("msg_1", now, body)
    assert verify_webhook(both, body, SECRET)["type"] == "job.failed"
    assert verify_webhook(both, body, new)["type"] == "job.failed"
