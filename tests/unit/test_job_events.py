"""A job's events on the wire: what the worker writes is what the API reads back."""

from __future__ import annotations

import pytest

from core.streams.events import JobEvent
from core.streams.protocol import ProtocolError, cancels_key, events_key

LOGPROB = {
    "token": 9,
    "text": "é",
    "logprob": -0.5,
    "top_logprobs": [{"token": 9, "text": "é", "logprob": -0.5}],
}


@pytest.mark.parametrize(
    "event",
    [
        JobEvent.running(),
        JobEvent.token_event(0, 17, "Hello"),
        JobEvent.token_event(41, 3, ""),
        JobEvent.token_event(2, 9, "naïve 🙂\n"),
        JobEvent.token_event(3, 9, "é", LOGPROB),
        JobEvent.done("succeeded", "length"),
        JobEvent.done("cancelled", "cancelled"),
        JobEvent.done("failed"),
    ],
)
def test_an_event_survives_its_encoding(event: JobEvent) -> None:
    wire: dict[bytes | str, bytes | str] = {
        k.encode(): v.encode() for k, v in event.encode().items()
    }
    assert JobEvent.decode(wire) == event


def test_the_data_a_client_sees() -> None:
    assert JobEvent.token_event(3, 5, "ab").data == {"index": 3, "token": 5, "text": "ab"}
    assert JobEvent.done("succeeded", "stop").data == {
        "status": "succeeded",
        "finish_reason": "stop",
    }
    assert JobEvent.running().data == {"status": "running"}
    with_logprob = JobEvent.token_event(3, 9, "é", LOGPROB).data
    assert with_logprob == {"index": 3, "token": 9, "text": "é", "logprob": LOGPROB}


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"k": "tokens"},
        {"k": "token", "i": "x"},
        {"k": b"\xff"},
        {"k": "token", "i": "0", "tok": "1", "lp": "{"},
        {"k": "token", "i": "0", "tok": "1", "lp": '{"text": "a"}'},
    ],
)
def test_a_malformed_event_is_one_error(fields: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        JobEvent.decode(fields)  # type: ignore[arg-type]


def test_a_jobs_keys_share_its_models_slot() -> None:
    assert events_key("ferry", "tiny", "j1") == "ferry:{tiny}:events:j1"
    assert cancels_key("ferry", "tiny") == "ferry:{tiny}:cancels"
