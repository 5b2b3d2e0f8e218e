"""The job submission body and how validation errors are worded."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.errors import _validation_message
from api.jobs.schemas import MAX_DEADLINE_MS, JobCreate, metadata_problem

MAX_METADATA_BYTES = 16_384  # the default of FERRY_MAX_METADATA_BYTES

VALID: dict[str, Any] = {"model": "sim", "input": {"cost": 1}}


def errors_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.raises(ValidationError) as info:
        JobCreate.model_validate(body)
    return [dict(e) for e in info.value.errors()]


# --- JobCreate ---------------------------------------------------------------


def test_minimal_body_and_defaults() -> None:
    job = JobCreate.model_validate(VALID)
    assert job.model == "sim"
    assert job.input == {"cost": 1}
    assert job.priority == "normal"
    assert job.deadline_ms is None
    assert job.callback_url is None
    assert job.idempotency_key is None
    assert job.metadata is None


@pytest.mark.parametrize(
    ("extra", "field", "value"),
    [
        ({"priority": "urgent"}, "priority", "urgent"),
        ({"priority": "bulk"}, "priority", "bulk"),
        ({"deadline_ms": 1}, "deadline_ms", 1),
        ({"deadline_ms": MAX_DEADLINE_MS}, "deadline_ms", MAX_DEADLINE_MS),
        ({"callback_url": "https://example.com/hook"}, "callback_url", "https://example.com/hook"),
        (
            {"callback_url": "http://10.0.0.5:8080/cb?x=1"},
            "callback_url",
            "http://10.0.0.5:8080/cb?x=1",
        ),
        ({"idempotency_key": "k" * 255}, "idempotency_key", "k" * 255),
        ({"metadata": {"a": [1, 2]}}, "metadata", {"a": [1, 2]}),
        ({"input": None}, "input", None),
    ],
)
def test_accepted_fields(extra: dict[str, Any], field: str, value: Any) -> None:
    assert getattr(JobCreate.model_validate({**VALID, **extra}), field) == value


def _compact_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _metadata_of_json_length(length: int) -> dict[str, str]:
    value = {"k": "x" * (length - _compact_size({"k": ""}))}
    assert _compact_size(value) == length
    return value


def test_metadata_is_measured_in_utf8_bytes() -> None:
    # "é" is 2 bytes in UTF-8 (6 characters when ASCII-escaped).
    fits = {"k": "é" * ((MAX_METADATA_BYTES - _compact_size({"k": ""})) // 2)}
    assert metadata_problem(fits, MAX_METADATA_BYTES) is None
    too_big = {"k": "é" * ((MAX_METADATA_BYTES - _compact_size({"k": ""})) // 2 + 1)}
    assert metadata_problem(too_big, MAX_METADATA_BYTES) == (
        f"must be at most {MAX_METADATA_BYTES} bytes of JSON"
    )


@pytest.mark.parametrize("limit", [0, 100, MAX_METADATA_BYTES])
def test_metadata_at_the_limit_is_accepted_and_one_byte_more_is_not(limit: int) -> None:
    assert metadata_problem(None, limit) is None
    if limit >= _compact_size({"k": ""}):
        assert metadata_problem(_metadata_of_json_length(limit), limit) is None
    assert metadata_problem(_metadata_of_json_length(max(limit, 8) + 1), limit) is not None


@pytest.mark.parametrize(
    ("extra", "loc", "type_"),
    [
        ({"deadline_ms": -5}, ("deadline_ms",), "greater_than"),
        ({"deadline_ms": 0}, ("deadline_ms",), "greater_than"),
        ({"deadline_ms": MAX_DEADLINE_MS + 1}, ("deadline_ms",), "less_than_equal"),
        ({"deadline_ms": "soon"}, ("deadline_ms",), "int_parsing"),
        ({"priority": "high"}, ("priority",), "enum"),
        ({"priority": "URGENT"}, ("priority",), "enum"),
        ({"priority": None}, ("priority",), "enum"),
        ({"colour": "red"}, ("colour",), "extra_forbidden"),
        ({"callback_url": "ftp://example.com/x"}, ("callback_url",), "value_error"),
        ({"callback_url": "example.com/hook"}, ("callback_url",), "value_error"),
        ({"callback_url": "http://"}, ("callback_url",), "value_error"),
        ({"callback_url": "javascript:alert(1)"}, ("callback_url",), "value_error"),
        ({"callback_url": "https://e.com/" + "a" * 2048}, ("callback_url",), "string_too_long"),
        ({"metadata": ["not", "a", "dict"]}, ("metadata",), "dict_type"),
        ({"model": ""}, ("model",), "string_too_short"),
        ({"model": "m" * 65}, ("model",), "string_too_long"),
        ({"idempotency_key": ""}, ("idempotency_key",), "string_too_short"),
    ],
)
def test_rejected_fields(extra: dict[str, Any], loc: tuple[str, ...], type_: str) -> None:
    errors = errors_of({**VALID, **extra})
    assert [(e["loc"], e["type"]) for e in errors] == [(loc, type_)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"callback_url": "ftp://example.com/x"}, "must be an absolute http(s) URL"),
    ],
)
def test_custom_validators_explain_themselves(extra: dict[str, Any], message: str) -> None:
    [error] = errors_of({**VALID, **extra})
    assert message in error["msg"]


@pytest.mark.parametrize("missing", ["model", "input"])
def test_required_fields(missing: str) -> None:
    body = {k: v for k, v in VALID.items() if k != missing}
    assert [(e["loc"], e["type"]) for e in errors_of(body)] == [((missing,), "missing")]


# --- _validation_message ----------------------------------------------------


def _error(type_: str, loc: tuple[Any, ...], msg: str = "bad") -> dict[str, Any]:
    return {"type": type_, "loc": loc, "msg": msg, "input": None}


@pytest.mark.parametrize(
    ("errors", "expected"),
    [
        ([], (422, "invalid_request", "invalid request")),
        (
            [_error("missing", ("body", "model"), "Field required")],
            (422, "invalid_request", "model: is required"),
        ),
        (
            [_error("extra_forbidden", ("body", "colour"), "Extra inputs are not permitted")],
            (422, "invalid_request", "colour: is not a known field"),
        ),
        (
            [_error("greater_than", ("body", "deadline_ms"), "Input should be greater than 0")],
            (422, "invalid_request", "deadline_ms: Input should be greater than 0"),
        ),
        (
            [_error("int_parsing", ("query", "limit"), "not an int")],
            (422, "invalid_request", "limit: not an int"),
        ),
        (
            [_error("string_type", ("body", "metadata", "tags", 0), "not a string")],
            (422, "invalid_request", "metadata.tags.0: not a string"),
        ),
        (
            [_error("model_attributes_type", ("body",), "not an object")],
            (422, "invalid_request", "body: not an object"),
        ),
        (
            [_error("missing", ("body", "model")), _error("extra_forbidden", ("body", "x"))],
            (422, "invalid_request", "model: is required; x: is not a known field"),
        ),
        (
            [_error("missing", ("body", "model")), _error("json_invalid", ("body", 7), "eof")],
            (400, "invalid_json", "request body is not valid JSON: eof"),
        ),
    ],
)
def test_validation_message(errors: list[dict[str, Any]], expected: tuple[int, str, str]) -> None:
    assert _validation_message(RequestValidationError(errors)) == expected


def test_validation_message_names_at_most_five_problems() -> None:
    errors = [_error("missing", ("body", f"f{n}")) for n in range(8)]
    status, type_, message = _validation_message(RequestValidationError(errors))
    assert (status, type_) == (422, "invalid_request")
    assert message.split("; ") == [f"f{n}: is required" for n in range(5)]


def test_validation_message_from_a_real_job_create_error() -> None:
    with pytest.raises(ValidationError) as info:
        JobCreate.model_validate({"input": 1, "priority": "high", "extra": True})
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    status, type_, message = _validation_message(RequestValidationError(errors))
    assert (status, type_) == (422, "invalid_request")
    parts = message.split("; ")
    assert "model: is required" in parts
    assert "extra: is not a known field" in parts
    assert any(p.startswith("priority: Input should be") for p in parts)
