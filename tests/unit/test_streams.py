"""Stream key names and the job message protocol."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
from redis.crc import key_slot

from core.streams.protocol import (
    PROTOCOL_VERSION,
    JobMessage,
    ProtocolError,
    bulk_seq_key,
    cancels_key,
    dead_letter_key,
    done_channel,
    events_key,
    is_wake,
    lane_streams,
    seq_key,
    stats_key,
    stream_key,
    tenants_key,
    versions_key,
    wake_key,
    workers_key,
)
from scheduler.vocabulary import LANES

FULL = JobMessage(
    job_id="0b8e6c2a-5f0e-4c57-9d1f-3a6d2a8c1e11",
    lane="vip",
    cost=17,
    enqueued_at_ms=1_700_000_000_123,
    deadline_at_ms=1_700_000_030_123,
    request_id="req-42",
)
BARE = JobMessage(job_id="j1", lane="bulk", cost=0, enqueued_at_ms=5)


Fields = Mapping[bytes | str, bytes | str]


def as_str(fields: Mapping[str, str]) -> Fields:
    """What redis-py returns with decode_responses."""
    widened: dict[bytes | str, bytes | str] = {k: v for k, v in fields.items()}
    return widened


def as_bytes(fields: dict[str, str]) -> Fields:
    """What redis-py returns without decode_responses."""
    return {k.encode(): v.encode() for k, v in fields.items()}


def test_encode_writes_short_string_fields() -> None:
    assert FULL.encode() == {
        "v": str(PROTOCOL_VERSION),
        "job": "0b8e6c2a-5f0e-4c57-9d1f-3a6d2a8c1e11",
        "lane": "vip",
        "cost": "17",
        "enq": "1700000000123",
        "dl": "1700000030123",
        "rid": "req-42",
    }


def test_encode_omits_absent_deadline_and_request_id() -> None:
    assert set(BARE.encode()) == {"v", "job", "lane", "cost", "enq"}


@pytest.mark.parametrize(
    "message",
    [
        FULL,
        BARE,
        JobMessage(job_id="j2", lane="urgent", cost=3, enqueued_at_ms=1, deadline_at_ms=2),
        JobMessage(job_id="j3", lane="normal", cost=3, enqueued_at_ms=1, request_id="r"),
        JobMessage(job_id="j4", lane="normal", cost=1, enqueued_at_ms=0, deadline_at_ms=0),
    ],
)
@pytest.mark.parametrize("transport", [as_str, as_bytes], ids=["str", "bytes"])
def test_round_trip(message: JobMessage, transport: Callable[[dict[str, str]], Fields]) -> None:
    fields = transport(message.encode())
    assert JobMessage.decode(fields) == message


def test_decode_mixed_bytes_and_str() -> None:
    fields: dict[bytes | str, bytes | str] = {
        b"v": "1",
        "job": b"j",
        b"lane": b"normal",
        "cost": "2",
        "enq": b"9",
    }
    assert JobMessage.decode(fields) == JobMessage(
        job_id="j", lane="normal", cost=2, enqueued_at_ms=9
    )


def test_decode_ignores_unknown_fields() -> None:
    fields = as_str({**BARE.encode(), "future": "x"})
    assert JobMessage.decode(fields) == BARE


def _without(field: str) -> Fields:
    fields = FULL.encode()
    del fields[field]
    return as_str(fields)


def _with(**changes: str) -> Fields:
    return as_str({**FULL.encode(), **changes})


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(_without("v"), id="missing-version"),
        pytest.param(_without("job"), id="missing-job"),
        pytest.param(_without("lane"), id="missing-lane"),
        pytest.param(_without("cost"), id="missing-cost"),
        pytest.param(_without("enq"), id="missing-enq"),
        pytest.param({}, id="empty"),
        pytest.param(_with(v="2"), id="future-version"),
        pytest.param(_with(v="0"), id="old-version"),
        pytest.param(_with(v="one"), id="non-numeric-version"),
        pytest.param(_with(lane="platinum"), id="unknown-lane"),
        pytest.param(_with(lane="URGENT"), id="lane-wrong-case"),
        pytest.param(_with(lane=""), id="empty-lane"),
        pytest.param(_with(cost="1.5"), id="fractional-cost"),
        pytest.param(_with(cost="abc"), id="non-integer-cost"),
        pytest.param(_with(cost=""), id="empty-cost"),
        pytest.param(_with(cost="-1"), id="negative-cost"),
        pytest.param(_with(enq="soon"), id="non-integer-enq"),
        pytest.param(_with(dl="tomorrow"), id="non-integer-deadline"),
        pytest.param({b"v": b"\xff\xfe", b"job": b"j"}, id="invalid-utf8"),
    ],
)
def test_malformed_messages_raise_protocol_error(fields: Fields) -> None:
    with pytest.raises(ProtocolError):
        JobMessage.decode(fields)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (_with(v="2"), "version"),
        (_with(lane="platinum"), "lane"),
        (_with(cost="-5"), "negative cost"),
    ],
)
def test_protocol_error_says_what_is_wrong(fields: Fields, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        JobMessage.decode(fields)


def test_decode_of_a_non_mapping_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        JobMessage.decode(None)  # type: ignore[arg-type]


def test_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


# --- key names ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (stream_key("ferry", "minilm", "urgent"), "ferry:{minilm}:urgent"),
        (stream_key("t1", "sim", "bulk"), "t1:{sim}:bulk"),
        (dead_letter_key("ferry", "minilm"), "ferry:{minilm}:dead"),
        (workers_key("ferry", "sim"), "ferry:{sim}:workers"),
        (stats_key("ferry", "minilm"), "ferry:{minilm}:stats"),
        (done_channel("ferry"), "ferry:done"),
    ],
)
def test_key_names(key: str, expected: str) -> None:
    assert key == expected


def test_lane_streams_most_urgent_first() -> None:
    assert lane_streams("ferry", "minilm") == [
        "ferry:{minilm}:urgent",
        "ferry:{minilm}:vip",
        "ferry:{minilm}:normal",
        "ferry:{minilm}:bulk",
    ]


def every_key_of(model: str) -> list[str]:
    tenant = "0b8e6c2a-5f0e-4c57-9d1f-3a6d2a8c1e11"
    return [
        *lane_streams("ferry", model),
        *(stream_key("ferry", model, lane, tenant) for lane in LANES),
        *(tenants_key("ferry", model, lane) for lane in LANES),
        dead_letter_key("ferry", model),
        workers_key("ferry", model),
        stats_key("ferry", model),
        versions_key("ferry", model),
        wake_key("ferry", model),
        seq_key("ferry", model),
        bulk_seq_key("ferry", model),
        cancels_key("ferry", model),
        events_key("ferry", model, tenant),
    ]


@pytest.mark.parametrize("model", ["minilm", "sim"])
def test_all_keys_of_a_model_share_one_cluster_slot(model: str) -> None:
    slots = {key_slot(k.encode()) for k in every_key_of(model)}
    assert slots == {key_slot(model.encode())}


def test_no_two_keys_of_a_model_are_one_key() -> None:
    # A counter named like a lane's stream would be INCRBY'd on a stream (WRONGTYPE).
    keys = every_key_of("sim")
    assert len(set(keys)) == len(keys), sorted(k for k in keys if keys.count(k) > 1)


def test_a_tenants_stream_is_named_under_its_lane() -> None:
    assert stream_key("ferry", "sim", "vip", "k1") == "ferry:{sim}:vip:t:k1"
    assert stream_key("ferry", "sim", "vip", None) == stream_key("ferry", "sim", "vip")
    assert tenants_key("ferry", "sim", "vip") == "ferry:{sim}:vip:tenants"


@pytest.mark.parametrize("convert", [as_str, as_bytes])
def test_the_tenant_travels_in_the_message(convert: Callable[[dict[str, str]], Fields]) -> None:
    message = JobMessage("j", "normal", 3, 10, tenant="k1")
    assert message.encode()["t"] == "k1"
    assert JobMessage.decode(convert(message.encode())) == message
    assert JobMessage.decode(convert(BARE.encode())).tenant is None


@pytest.mark.parametrize("convert", [as_str, as_bytes])
def test_the_trace_context_travels_in_the_message(
    convert: Callable[[dict[str, str]], Fields],
) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    message = JobMessage("j", "normal", 3, 10, trace_context=traceparent)
    assert message.encode()["tp"] == traceparent
    assert JobMessage.decode(convert(message.encode())) == message
    # A job sent without tracing carries no field for it.
    assert "tp" not in BARE.encode()
    assert JobMessage.decode(convert(BARE.encode())).trace_context is None


@pytest.mark.parametrize("convert", [as_str, as_bytes])
def test_a_wake_marker_is_told_from_a_job(convert: Callable[[dict[str, str]], Fields]) -> None:
    assert is_wake(convert({"v": "1", "wake": "k1"}))
    assert not is_wake(convert(FULL.encode()))
    assert not is_wake(None)
