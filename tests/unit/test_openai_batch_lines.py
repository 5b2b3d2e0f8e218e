"""An OpenAI batch's lines: requests read into backfill items, results written in OpenAI's
format, the batch object from its backfill."""

from __future__ import annotations

import base64
import datetime as dt
import json
import struct
from types import SimpleNamespace
from typing import Any

import pytest

from api.batches.lines import (
    ERROR,
    OUTPUT,
    RequestLines,
    batch_object,
    metadata_problem,
    request_line,
    request_model,
    role_of,
    window_hours,
)
from core.db.backfills import LineError
from core.db.schema import Backfill, OpenAIBatch
from core.models.catalog import ModelSpec
from tests.unit.test_catalog import shipped


@pytest.fixture(scope="module")
def minilm() -> ModelSpec:
    return shipped("minilm")


def line(**fields: Any) -> bytes:
    value = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "minilm", "input": "a cat"},
    }
    value.update(fields)
    return json.dumps(value).encode()


def test_a_request_becomes_one_text_with_its_options(minilm: ModelSpec) -> None:
    parse = RequestLines("/v1/embeddings", "minilm", minilm)
    item = parse(line(), 4)
    assert item is not None and (item.line, item.custom_id, item.input) == (4, "a", "a cat")
    assert item.cost == minilm.validate("a cat").cost and item.metadata == {"openai": "batch"}
    options = {"model": "minilm", "input": ["a cat"], "encoding_format": "base64", "user": "u"}
    listed = parse(line(body={**options, "dimensions": 384}), 1)
    assert listed is not None and listed.input == "a cat"
    assert listed.metadata == {
        "openai": "batch",
        "encoding_format": "base64",
        "dimensions": 384,
        "user": "u",
    }
    assert parse(b"  ", 2) is None


@pytest.mark.parametrize(
    ("fields", "message", "code"),
    [
        ({"method": "PUT"}, "method: must be POST", "invalid_method"),
        ({"url": "/v1/chat/completions"}, "url: must be /v1/embeddings", "invalid_url"),
        ({"extra": 1}, "unknown field(s): extra", "invalid_request"),
        ({"custom_id": ""}, "custom_id: must be a non-empty string", "invalid_request"),
        ({"body": "x"}, "body: must be a JSON object", "missing_required_parameter"),
        ({"body": {"model": "sim", "input": "x"}}, "body.model: 'sim'", "mismatched_model"),
        ({"body": {"model": "minilm"}}, "body.input: one text", "missing_required_parameter"),
        ({"body": {"model": "minilm", "input": ["a", "b"]}}, "body.input: one text", None),
        ({"body": {"model": "minilm", "input": "x", "n": 1}}, "body: unknown field(s): n", None),
        (
            {"body": {"model": "minilm", "input": "x", "encoding_format": "int8"}},
            "body.encoding_format",
            None,
        ),
        ({"body": {"model": "minilm", "input": "x", "dimensions": 0}}, "positive integer", None),
        ({"body": {"model": "minilm", "input": "x", "dimensions": 64}}, "only 384", None),
        ({"body": {"model": "minilm", "input": "x", "user": "u" * 257}}, "body.user", None),
        ({"body": {"model": "minilm", "input": "x\u0000"}}, "body.input: must not contain", None),
        ({"body": {"model": "minilm", "input": ""}}, "body.input", None),
    ],
)
def test_a_bad_request_names_its_line_field_and_why(
    minilm: ModelSpec, fields: dict[str, Any], message: str, code: str | None
) -> None:
    parse = RequestLines("/v1/embeddings", "minilm", minilm)
    with pytest.raises(LineError) as refused:
        parse(line(**fields), 7)
    assert refused.value.line == 7 and message in refused.value.message
    assert refused.value.code == (code or "invalid_request")


def test_a_line_that_is_not_a_json_object(minilm: ModelSpec) -> None:
    parse = RequestLines("/v1/embeddings", "minilm", minilm)
    for raw in (b"{", b"[1]", b"\xff"):
        with pytest.raises(LineError) as refused:
            parse(raw, 2)
        assert refused.value.code == "invalid_json_line"
    assert request_model(line(), 1) == "minilm"
    with pytest.raises(LineError, match=r"body\.model"):
        request_model(line(body={"input": "x"}), 1)


def test_a_model_without_vectors_cannot_read_batches() -> None:
    with pytest.raises(ValueError, match="does not produce embeddings"):
        RequestLines("/v1/embeddings", "sim", shipped("sim"))


def row(status: str, output: Any = None, **extra: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {
        "id": "0b0f4c2e-0000-4000-8000-000000000001",
        "custom_id": "req-1",
        "status": status,
        "output": output,
        "error": None,
        "cost": 7,
        "metadata_": {"openai": "batch"},
    }
    fields.update(extra)
    return SimpleNamespace(**fields)


def test_a_result_in_openais_output_format() -> None:
    vector = [0.6, 0.8, 0.0]
    record = request_line(row("succeeded", vector), "minilm")
    assert record["id"] == "batch_req_0b0f4c2e000040008000000000000001"
    assert record["custom_id"] == "req-1" and record["error"] is None
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"] == row("x").id
    assert response["body"] == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": "minilm",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    cut = request_line(
        row("succeeded", vector, metadata_={"dimensions": 1, "encoding_format": "base64"}), "m"
    )
    encoded = cut["response"]["body"]["data"][0]["embedding"]
    assert struct.unpack("<1f", base64.b64decode(encoded)) == (1.0,)  # cut, normalised again


def test_what_did_not_succeed_goes_to_the_error_file() -> None:
    failed = request_line(row("failed", error="CUDA out of memory"), "minilm")
    assert failed["error"] is None and failed["response"]["status_code"] == 500
    assert failed["response"]["body"]["error"]["message"] == "CUDA out of memory"
    assert failed["response"]["body"]["error"]["code"] == "job_failed"
    for status, code in (("expired", "batch_expired"), ("cancelled", "batch_cancelled")):
        record = request_line(row(status), "minilm")
        assert record["response"] is None and record["error"]["code"] == code
    odd = request_line(row("succeeded", {"label": "cat"}), "minilm")
    assert odd["response"]["body"]["error"]["code"] == "bad_output"
    assert role_of("succeeded", [1.0]) == OUTPUT
    for status, output in (("succeeded", "text"), ("failed", None), ("expired", None)):
        assert role_of(status, output) == ERROR


def test_completion_windows_and_metadata() -> None:
    assert window_hours("24h") == 24 and window_hours("1h") == 1 and window_hours("720h") == 720
    for bad in ("0h", "721h", "24", "1d", "h", "-1h", "1.5h"):
        with pytest.raises(ValueError, match="completion_window"):
            window_hours(bad)
    assert metadata_problem(None) is None and metadata_problem({"a": "b"}) is None
    assert metadata_problem({str(n): "v" for n in range(17)}) == "at most 16 pairs"
    assert "key" in (metadata_problem({"k" * 65: "v"}) or "")
    assert "value" in (metadata_problem({"k": "v" * 513}) or "")


def test_the_batch_object_follows_its_backfill() -> None:
    created = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    batch = OpenAIBatch(
        id="batch_1",
        endpoint="/v1/embeddings",
        input_file_id="file-1",
        completion_window="24h",
        model="minilm",
        created_at=created,
    )
    backfill = Backfill(
        status="expiring",
        total=10,
        completed=4,
        failed=1,
        expired=3,
        cancelled=2,
        in_progress_at=created,
        expires_at=created + dt.timedelta(hours=24),
        finished_at=None,
    )
    running = batch_object(batch, backfill, {})
    assert running["status"] == "in_progress"  # expiring is not a status OpenAI has
    assert running["request_counts"] == {"total": 10, "completed": 4, "failed": 6}
    assert running["expires_at"] - running["created_at"] == 24 * 3600
    assert running["usage"] is None and running["output_file_id"] is None
    ended = created + dt.timedelta(hours=25)
    backfill.status, backfill.finished_at = "expired", ended
    done = batch_object(batch, backfill, {OUTPUT: "file-o", ERROR: "file-e"}, tokens=40)
    assert done["status"] == "expired" and done["expired_at"] == int(ended.timestamp())
    assert done["completed_at"] is None and done["cancelled_at"] is None
    assert (done["output_file_id"], done["error_file_id"]) == ("file-o", "file-e")
    assert done["usage"]["input_tokens"] == done["usage"]["total_tokens"] == 40
    batch.errors = [{"code": "invalid_url", "message": "m", "param": "url", "line": 2}]
    refused = batch_object(batch, None, {})
    assert refused["status"] == "failed" and refused["errors"]["data"][0]["line"] == 2
    assert refused["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
