"""A batch's completions and chat completions lines: read into generation items, written
back as OpenAI's batch output lines."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api.batches.lines import ERROR, OUTPUT, RequestLines, request_line, role_of
from core.db.backfills import LineError
from core.models.catalog import ModelSpec
from core.models.reader import load_repository
from tests.causal_lm_files import catalog_spec, write_model
from tests.unit.test_catalog import shipped

CHAT = "/v1/chat/completions"


@pytest.fixture
def tiny(tmp_path: Path) -> ModelSpec:
    write_model(tmp_path, "tiny-lm", context_tokens=64)
    return catalog_spec(load_repository(tmp_path, environ={})["tiny-lm"])


def line(url: str = CHAT, **body: Any) -> bytes:
    value = {"custom_id": "c-1", "method": "POST", "url": url, "body": {"model": "tiny-lm", **body}}
    return json.dumps(value).encode()


def test_a_chat_line_is_the_generation_input_post_would_store(tiny: ModelSpec) -> None:
    parse = RequestLines(CHAT, "tiny-lm", tiny)
    messages = [{"role": "user", "content": "hello world"}]
    item = parse(line(messages=messages, max_completion_tokens=5, seed=2, user="u"), 3)
    assert item is not None and (item.line, item.custom_id) == (3, "c-1")
    assert item.input == tiny.validate({"messages": messages, "max_tokens": 5, "seed": 2}).input
    assert item.cost == item.input["prompt_tokens"] + 5
    assert item.metadata == {"openai": "batch", "user": "u"}
    completion = RequestLines("/v1/completions", "tiny-lm", tiny)(
        line("/v1/completions", prompt="the cat", max_tokens=4), 1
    )
    assert completion is not None and completion.input["prompt"] == "the cat"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "a"}], "n": 3}, "body.n: must be 1"),
        ({"messages": [{"role": "user", "content": "a"}], "stream": True}, "body.stream: "),
        ({"messages": [{"role": "user", "content": "a"}], "priority": "vip"}, "body.priority: "),
        ({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 500},
         "body.max_completion_tokens: is 500"),
        ({"messages": [{"role": "tool", "content": "a"}]}, "body.messages[0].role: "),
    ],
)  # fmt: skip
def test_a_bad_line_names_the_field(tiny: ModelSpec, body: dict[str, Any], message: str) -> None:
    with pytest.raises(LineError) as refused:
        RequestLines(CHAT, "tiny-lm", tiny)(line(**body), 7)
    assert refused.value.line == 7
    assert refused.value.message.startswith(message), refused.value.message


def test_the_endpoint_needs_a_model_of_its_kind(tiny: ModelSpec) -> None:
    with pytest.raises(ValueError, match="not a generation model"):
        RequestLines(CHAT, "minilm", shipped("minilm"))
    with pytest.raises(ValueError, match="does not produce embeddings"):
        RequestLines("/v1/embeddings", "tiny-lm", tiny)


OUTPUT_VALUE = {
    "text": "sat on",
    "token_ids": [12, 13],
    "finish_reason": "length",
    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
}


def row(status: str, output: Any = None, error: str | None = None) -> Any:
    return SimpleNamespace(
        id="0b5c2a3e-0000-4000-8000-000000000001",
        custom_id="c-1",
        status=status,
        output=output,
        error=error,
        cost=9,
        metadata_={"openai": "batch"},
        created_at=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    )


def test_a_finished_line_is_a_chat_completion_in_openais_batch_shape() -> None:
    done = row("succeeded", OUTPUT_VALUE)
    assert role_of(done.status, done.output) == OUTPUT
    record = request_line(done, "tiny-lm", CHAT)
    assert record["id"] == "batch_req_0b5c2a3e000040008000000000000001"
    assert record["custom_id"] == "c-1" and record["error"] is None
    response = record["response"]
    assert (response["status_code"], response["request_id"]) == (200, done.id)
    body = response["body"]
    assert body["object"] == "chat.completion" and body["created"] == 1704067200
    assert body["choices"][0]["message"]["content"] == "sat on"
    assert body["usage"] == OUTPUT_VALUE["usage"]
    text = request_line(done, "tiny-lm", "/v1/completions")["response"]["body"]
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "sat on"


def test_a_failed_line_goes_to_the_error_file() -> None:
    failed = row("failed", error="the worker died")
    assert role_of(failed.status, failed.output) == ERROR
    record = request_line(failed, "tiny-lm", CHAT)
    assert record["response"]["status_code"] == 500
    assert record["response"]["body"]["error"]["message"] == "the worker died"


def test_an_echo_line_scores_its_prompt_and_its_output_line_echoes_it(tiny: ModelSpec) -> None:
    parse = RequestLines("/v1/completions", "tiny-lm", tiny)
    body = {"prompt": "the cat", "echo": True, "logprobs": 1, "max_tokens": 0}
    item = parse(line("/v1/completions", **body), 1)
    assert item is not None
    assert (item.input["prompt_logprobs"], item.input["max_tokens"]) == (1, 1)
    assert item.metadata == {"openai": "batch", "echo": "prompt_only"}
    scored = {
        **OUTPUT_VALUE,
        "logprobs": [{"token": 12, "text": "sat", "logprob": -1.0, "top_logprobs": []}],
        "prompt_logprobs": [
            {"token": 3, "text": "the", "logprob": None, "top_logprobs": []},
            {"token": 4, "text": " cat", "logprob": -3.0, "top_logprobs": []},
        ],
    }
    done = row("succeeded", scored)
    done.metadata_, done.input = item.metadata, item.input
    answer = request_line(done, "tiny-lm", "/v1/completions")["response"]["body"]
    choice = answer["choices"][0]
    assert choice["text"] == "the cat"  # the prompt alone: max_tokens 0
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0]
    assert answer["usage"]["completion_tokens"] == 0
    done.metadata_ = {"openai": "batch", "echo": "prompt"}
    choice = request_line(done, "tiny-lm", "/v1/completions")["response"]["body"]["choices"][0]
    assert choice["text"] == "the catsat on"
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -1.0]
