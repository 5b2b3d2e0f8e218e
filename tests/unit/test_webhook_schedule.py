"""Webhook retries and signatures: the schedule, Retry-After, signing secrets, headers."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from core.config.settings import WEBHOOK_SCHEDULE_S, Settings
from core.db.keys import new_webhook_secret, signing_secrets
from core.db.schema import ApiKey
from core.db.webhooks import next_delay_s, parse_retry_after
from workers.tasks.webhooks import USER_AGENT, signed_headers

SCHEDULE = (0.0, 5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 50400.0, 72000.0, 86400.0)
NOW = dt.datetime(2025, 3, 4, 12, 0, 0, tzinfo=dt.UTC)


# --- next_delay_s ----------------------------------------------------------------


def test_default_schedule_is_the_standard_webhooks_one() -> None:
    # What the webhook task reads (workers.tasks.webhooks), not the constant behind it.
    settings = Settings(database_url="sqlite://")
    assert settings.webhook_retry_schedule_s == list(SCHEDULE)
    assert tuple(WEBHOOK_SCHEDULE_S) == SCHEDULE


def test_schedule_walked_step_by_step() -> None:
    delays: list[float] = []
    step = 0
    while (delay := next_delay_s(WEBHOOK_SCHEDULE_S, step, jitter=0.0)) is not None:
        delays.append(delay)
        step += 1
        assert step <= 20, "the schedule never ends"
    assert delays == list(SCHEDULE)
    assert step == 10
    assert next_delay_s(WEBHOOK_SCHEDULE_S, 10) is None
    assert next_delay_s(WEBHOOK_SCHEDULE_S, 11) is None


@pytest.mark.parametrize(("step", "expected"), list(enumerate(SCHEDULE)))
def test_each_step_without_jitter(step: int, expected: float) -> None:
    assert next_delay_s(SCHEDULE, step) == expected


def test_empty_schedule_is_spent_at_once() -> None:
    assert next_delay_s((), 0) is None


@pytest.mark.parametrize(
    ("step", "retry_after_s", "expected"),
    [
        (1, 60.0, 60.0),  # asks for longer than 5 s: honoured
        (0, 1.0, 1.0),  # longer than 0 s
        (2, 301.0, 301.0),
        (1, 10**6, 86400.0),  # capped at the schedule's longest delay
        (9, 10**6, 86400.0),
        (3, 86400.0, 86400.0),
        (3, float("inf"), 86400.0),
        (3, 60.0, 1800.0),  # shorter than the schedule: ignored
        (3, 1800.0, 1800.0),
        (3, 0.0, 1800.0),
        (9, 100.0, 86400.0),
        (3, None, 1800.0),
    ],
)
def test_retry_after(step: int, retry_after_s: float | None, expected: float) -> None:
    assert next_delay_s(SCHEDULE, step, retry_after_s) == expected


def test_retry_after_does_not_extend_a_spent_schedule() -> None:
    assert next_delay_s(SCHEDULE, len(SCHEDULE), retry_after_s=60.0) is None


def test_retry_after_cap_is_the_largest_delay_not_the_last() -> None:
    assert next_delay_s((10.0, 500.0, 20.0), 2, retry_after_s=10_000.0) == 500.0


@pytest.mark.parametrize(
    ("unit", "expected"),
    [
        (0.0, 1800.0 * 0.8),  # low bound: delay * (1 - jitter)
        (0.5, 1800.0),  # the middle: exact
        (0.999, 1800.0 * (1.0 + 0.2 * 0.998)),  # just under the high bound
        (0.25, 1800.0 * 0.9),
    ],
)
def test_jitter(unit: float, expected: float) -> None:
    assert next_delay_s(SCHEDULE, 3, jitter=0.2, unit=unit) == pytest.approx(expected)


def test_jitter_stays_within_bounds() -> None:
    for step, scheduled in enumerate(SCHEDULE):
        for unit in (0.0, 0.1, 0.5, 0.9, 0.999):
            delay = next_delay_s(SCHEDULE, step, jitter=0.1, unit=unit)
            assert delay is not None
            assert scheduled * 0.9 - 1e-9 <= delay <= scheduled * 1.1


def test_jitter_applies_to_an_honoured_retry_after() -> None:
    assert next_delay_s(SCHEDULE, 1, 60.0, jitter=0.5, unit=0.0) == pytest.approx(30.0)
    assert next_delay_s(SCHEDULE, 1, 60.0, jitter=0.5, unit=0.5) == pytest.approx(60.0)


def test_jitter_never_gives_a_negative_delay() -> None:
    assert next_delay_s(SCHEDULE, 1, jitter=2.0, unit=0.0) == 0.0


def test_default_unit_means_no_jitter() -> None:
    assert next_delay_s(SCHEDULE, 4, jitter=0.5) == 7200.0


# --- parse_retry_after -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("120", 120.0),
        (" 120 ", 120.0),
        ("0", 0.0),
        ("86400", 86400.0),
        # HTTP dates, relative to NOW (2025-03-04 12:00:00 UTC)
        ("Tue, 04 Mar 2025 12:02:00 GMT", 120.0),
        ("Tue, 04 Mar 2025 13:00:00 GMT", 3600.0),
        ("Wed, 05 Mar 2025 12:00:00 GMT", 86400.0),
        ("Tue, 04 Mar 2025 14:00:30 +0200", 30.0),  # another zone
        ("Tue, 04 Mar 2025 12:00:45 -0000", 45.0),  # no zone: taken as UTC
        ("Tue, 04 Mar 2025 12:00:00 GMT", 0.0),
        # in the past: no wait
        ("Tue, 04 Mar 2025 11:59:59 GMT", 0.0),
        ("Mon, 01 Jan 2024 00:00:00 GMT", 0.0),
        # garbage
        ("soon", None),
        ("-5", None),
        ("1.5", None),
        ("12 seconds", None),
        ("Tue, 99 Mar 2025 12:00:00 GMT", None),
        ("", None),
        ("   ", None),
        (None, None),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value, NOW) == expected


@pytest.mark.parametrize("value", ["\xb2", "\xb9\xb2\xb3", "1\xb2"])
def test_parse_retry_after_superscript_digits_are_garbage(value: str) -> None:
    # http.client decodes header values as Latin-1, so a receiver can send bytes
    # that become "\xb2" (superscript two): str.isdigit() says True, float() refuses.
    assert parse_retry_after(value, NOW) is None


# --- signing_secrets -----------------------------------------------------------------


def key(
    current: str | None, previous: str | None = None, until: dt.datetime | None = None
) -> ApiKey:
    return ApiKey(
        id="0123456789abcdef",
        name="test",
        salt="00",
        secret_hash="00",
        webhook_secret=current,
        previous_webhook_secret=previous,
        previous_webhook_secret_until=until,
    )


LATER = NOW + dt.timedelta(hours=1)
EARLIER = NOW - dt.timedelta(seconds=1)


@pytest.mark.parametrize(
    ("api_key", "expected"),
    [
        (key("whsec_new"), ["whsec_new"]),
        (key("whsec_new", "whsec_old", LATER), ["whsec_new", "whsec_old"]),
        (key("whsec_new", "whsec_old", EARLIER), ["whsec_new"]),  # grace is over
        (key("whsec_new", "whsec_old", NOW), ["whsec_new"]),  # ends exactly now
        (key("whsec_new", "whsec_old", None), ["whsec_new"]),  # no end: not in grace
        (key("whsec_new", None, LATER), ["whsec_new"]),
        (key(None), []),
        (key(None, "whsec_old", LATER), ["whsec_old"]),
    ],
)
def test_signing_secrets(api_key: ApiKey, expected: list[str]) -> None:
    assert signing_secrets(api_key, NOW) == expected


# --- signed_headers, verified as a receiver would ----------------------------------------

BODY = json.dumps(
    {"type": "job.succeeded", "timestamp": "2025-03-04T12:00:00Z", "data": {"id": "j1"}},
    separators=(",", ":"),
)


def now() -> dt.datetime:
    # The receiver checks the timestamp against its own clock (5 minutes' tolerance).
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def test_signed_headers_shape() -> None:
    secret = new_webhook_secret()
    at = now()
    headers = signed_headers("msg_1", BODY, [secret], at)
    assert set(headers) == {
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "Content-Type",
        "User-Agent",
    }
    assert headers["webhook-id"] == "msg_1"
    assert headers["webhook-timestamp"] == str(int(at.timestamp()))
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"] == USER_AGENT
    signatures = headers["webhook-signature"].split(" ")
    assert len(signatures) == 1
    assert signatures[0].startswith("v1,")


def test_new_webhook_secret() -> None:
    secret = new_webhook_secret()
    assert secret.startswith("whsec_")
    assert secret != new_webhook_secret()
    Webhook(secret)  # a secret the library accepts


def test_current_secret_verifies() -> None:
    secret = new_webhook_secret()
    headers = signed_headers("msg_1", BODY, [secret], now())
    assert Webhook(secret).verify(BODY, headers) == json.loads(BODY)
    assert Webhook(secret).verify(BODY.encode(), headers) == json.loads(BODY)


def test_both_secrets_verify_during_the_grace() -> None:
    old, new = new_webhook_secret(), new_webhook_secret()
    secrets = signing_secrets(key(new, old, LATER), NOW)
    assert secrets == [new, old]
    headers = signed_headers("msg_2", BODY, secrets, now())
    assert len(headers["webhook-signature"].split(" ")) == 2
    assert Webhook(new).verify(BODY, headers) == json.loads(BODY)
    assert Webhook(old).verify(BODY, headers) == json.loads(BODY)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_webhook_secret()).verify(BODY, headers)


def test_previous_secret_fails_after_the_grace() -> None:
    old, new = new_webhook_secret(), new_webhook_secret()
    headers = signed_headers("msg_3", BODY, signing_secrets(key(new, old, EARLIER), NOW), now())
    assert Webhook(new).verify(BODY, headers) == json.loads(BODY)
    with pytest.raises(WebhookVerificationError):
        Webhook(old).verify(BODY, headers)


def test_wrong_secret_fails() -> None:
    headers = signed_headers("msg_4", BODY, [new_webhook_secret()], now())
    with pytest.raises(WebhookVerificationError):
        Webhook(new_webhook_secret()).verify(BODY, headers)


@pytest.mark.parametrize(
    "altered",
    [
        BODY.replace("j1", "j2"),
        BODY + " ",
        BODY.replace("succeeded", "failed"),
    ],
)
def test_altered_body_fails(altered: str) -> None:
    secret = new_webhook_secret()
    headers = signed_headers("msg_5", BODY, [secret], now())
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(altered, headers)


def test_altered_id_or_timestamp_fails() -> None:
    secret = new_webhook_secret()
    headers = signed_headers("msg_6", BODY, [secret], now())
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY, {**headers, "webhook-id": "msg_7"})
    later = str(int(headers["webhook-timestamp"]) + 1)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY, {**headers, "webhook-timestamp": later})
