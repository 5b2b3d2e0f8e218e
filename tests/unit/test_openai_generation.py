"""OpenAI's completions requests as generation jobs, and the objects a job's output becomes."""

from __future__ import annotations

from typing import Any

import pytest

from api.openai.generation import (
    Echo,
    ParamError,
    chunk_object,
    completion_object,
    logprobs_object,
    parse_request,
    usage_chunk,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_chat_request_becomes_a_generation_input() -> None:
    asked = parse_request(
        "chat",
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "stop": ["\n"],
            "seed": 3,
            "n": 1,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logprobs": False,
            "tools": None,
            "user": "u-1",
            "stream": True,
            "stream_options": {"include_usage": True},
            "priority": "vip",
            "deadline_ms": 5000,
        },
    )
    assert asked.input == {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"}],
        "max_tokens": 7,
        "temperature": 0,
        "stop": ["\n"],
        "seed": 3,
        # Passed on as given: the generation input's check takes them, 0 as absent.
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
    }
    assert (asked.stream, asked.include_usage, asked.user) == (True, True, "u-1")
    assert (asked.priority, asked.deadline_ms) == ("vip", 5000)
    assert asked.param("max_tokens") == "max_completion_tokens"
    assert asked.param("input") == "messages"


def test_a_completions_prompt_may_be_a_list_of_one() -> None:
    asked = parse_request("completions", {"model": "m", "prompt": ["the cat"], "max_tokens": 4})
    assert asked.input == {"prompt": "the cat", "max_tokens": 4}
    assert not asked.stream and asked.param("max_tokens") == "max_tokens"


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": ["a", [1]]}, "prompt"),
        ("completions", {"prompt": [True]}, "prompt"),
        ("completions", {"prompt": ["a"] * 65}, "prompt"),
        ("completions", {"prompt": ["a"] * 9, "n": 8}, "n"),
        ("completions", {}, "prompt"),
        ("completions", {"prompt": "a", "n": 17}, "n"),
        ("completions", {"prompt": "a", "n": 0}, "n"),
        ("chat", {"messages": MESSAGES, "n": True}, "n"),
        ("completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
        ("completions", {"prompt": "a", "logprobs": True}, "logprobs"),
        ("completions", {"prompt": "a", "echo": True, "stream": True}, "echo"),
        ("completions", {"prompt": "a", "echo": 1}, "echo"),
        ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("chat", {"messages": MESSAGES, "echo": True}, "echo"),
        ("completions", {"prompt": "a", "best_of": 3}, "best_of"),
        ("completions", {"prompt": "a", "messages": MESSAGES}, "messages"),
        ("completions", {"prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens"),
        ("chat", {"messages": MESSAGES, "logprobs": 1}, "logprobs"),
        ("chat", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"messages": MESSAGES, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        (
            "chat",
            {"messages": MESSAGES, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("chat", {"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 3}, "max_tokens"),
        (
            "chat",
            {"messages": MESSAGES, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "chat",
            {"messages": MESSAGES, "stream": True, "stream_options": {"x": 1}},
            "stream_options.x",
        ),
        ("chat", {"messages": MESSAGES, "stream": "yes"}, "stream"),
        (
            "chat",
            {"messages": MESSAGES, "ferry_cancel_on_disconnect": True},
            "ferry_cancel_on_disconnect",
        ),
        ("chat", {"messages": MESSAGES, "priority": "fast"}, "priority"),
        ("chat", {"messages": MESSAGES, "deadline_ms": 0}, "deadline_ms"),
        ("chat", {"messages": MESSAGES, "user": "u" * 257}, "user"),
        ("chat", {"messages": MESSAGES, "best_of": 1}, "best_of"),
        ("completions", {"prompt": "a", "tools": []}, "tools"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ("chat", {}, "messages"),
        ("chat", {"messages": MESSAGES, "model": ""}, "model"),
    ],
)
def test_each_refusal_names_openais_parameter(
    endpoint: Any, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ParamError) as refused:
        parse_request(endpoint, {"model": "m", **body})
    assert refused.value.param == param
    assert str(refused.value).startswith(f"{param}: ")


def test_a_batch_line_takes_none_of_ferrys_own_fields() -> None:
    with pytest.raises(ParamError) as refused:
        parse_request(
            "chat", {"model": "m", "messages": MESSAGES, "priority": "vip"}, extensions=False
        )
    assert refused.value.param == "priority"


OUTPUT = {
    "text": "hello",
    "token_ids": [1, 2],
    "finish_reason": "stop",
    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
}
JOB = "0b5c2a3e-0000-4000-8000-000000000001"


def test_a_finished_job_as_openais_objects() -> None:
    chat = completion_object("chat", JOB, 1700000000, "m", OUTPUT)
    assert chat["id"] == "chatcmpl-0b5c2a3e000040008000000000000001"
    assert chat["object"] == "chat.completion" and chat["created"] == 1700000000
    assert chat["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hello", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert chat["usage"] == OUTPUT["usage"]
    text = completion_object("completions", JOB, 1, "m", OUTPUT)
    assert text["object"] == "text_completion" and text["id"].startswith("cmpl-")
    assert text["choices"][0]["text"] == "hello"


def test_the_chunks_of_a_stream() -> None:
    first = chunk_object("chat", JOB, 1, "m", text="", role=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk_object("chat", JOB, 1, "m", text="lo")["choices"][0]["delta"] == {"content": "lo"}
    last = chunk_object("chat", JOB, 1, "m", finish_reason="length")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    assert chunk_object("completions", JOB, 1, "m", text="lo")["choices"][0]["text"] == "lo"
    usage = usage_chunk("chat", JOB, 1, "m", OUTPUT["usage"])  # type: ignore[arg-type]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6


@pytest.mark.parametrize(
    ("endpoint", "body", "asked"),
    [
        ("chat", {"logprobs": True}, 0),
        ("chat", {"logprobs": True, "top_logprobs": 20}, 20),
        ("chat", {"logprobs": True, "top_logprobs": None}, 0),
        ("chat", {"logprobs": False}, None),
        ("chat", {"logprobs": None, "top_logprobs": None}, None),
        ("completions", {"logprobs": 5}, 5),
        ("completions", {"logprobs": 0}, 0),
        ("completions", {"logprobs": None}, None),
    ],
)
def test_logprobs_asked_the_openai_ways_become_one_count(
    endpoint: Any, body: dict[str, Any], asked: int | None
) -> None:
    what = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": "a"}
    found = parse_request(endpoint, {"model": "m", **what, **body}).input
    assert found.get("logprobs") == asked
    assert ("logprobs" in found) == (asked is not None)


LOGPROBS = [
    {
        "token": 7,
        "text": "hel",
        "logprob": -0.5,
        "top_logprobs": [
            {"token": 7, "text": "hel", "logprob": -0.5},
            {"token": 9, "text": "\ufffd", "logprob": -1.25},
        ],
    },
    {"token": 8, "text": "lo", "logprob": -0.125, "top_logprobs": []},
]


def test_a_finished_jobs_logprobs_in_openais_two_shapes() -> None:
    output = {**OUTPUT, "logprobs": LOGPROBS}
    chat = completion_object("chat", JOB, 1, "m", output)["choices"][0]["logprobs"]
    assert chat == {
        "content": [
            {
                "token": "hel",
                "logprob": -0.5,
                "bytes": [104, 101, 108],
                "top_logprobs": [
                    {"token": "hel", "logprob": -0.5, "bytes": [104, 101, 108]},
                    # Half a character: the replacement character's bytes.
                    {"token": "\ufffd", "logprob": -1.25, "bytes": [239, 191, 189]},
                ],
            },
            {"token": "lo", "logprob": -0.125, "bytes": [108, 111], "top_logprobs": []},
        ],
        "refusal": None,
    }
    text = completion_object("completions", JOB, 1, "m", output)["choices"][0]["logprobs"]
    assert text == {
        "tokens": ["hel", "lo"],
        "token_logprobs": [-0.5, -0.125],
        # The sampled token's logprob always among them, as OpenAI's (up to k + 1).
        "top_logprobs": [{"hel": -0.5, "\ufffd": -1.25}, {"lo": -0.125}],
        "text_offset": [0, 3],
    }
    # A stream's later chunk counts its offsets from the characters sent before it.
    assert logprobs_object("completions", LOGPROBS[1:], 3)["text_offset"] == [3]
    streamed = chunk_object("chat", JOB, 1, "m", text="lo", logprobs={"content": []})
    assert streamed["choices"][0]["logprobs"] == {"content": []}


def test_a_streams_logprobs_go_once_each_by_token_index() -> None:
    from api.openai.completions import _ChunkLogprobs

    found = _ChunkLogprobs("completions")
    found.add(4, LOGPROBS[0])  # streamed: token 4 (tokens 0 to 3 were streamed without)
    first = found.take()
    assert first is not None and first["tokens"] == ["hel"]
    found.add(4, LOGPROBS[0])  # the same token again (a stream read twice): not sent again
    assert found.take() is None
    output = [LOGPROBS[1]] * 4 + [LOGPROBS[0]] + [LOGPROBS[1]]
    last = found.take(output)  # the rest from the output: 0 to 3 and 5, none twice
    assert last is not None and last["tokens"] == ["lo"] * 5
    assert last["text_offset"] == [3, 5, 7, 9, 11]
    assert found.take(output) is None


@pytest.mark.parametrize(
    ("body", "stored", "generated"),
    [
        ({"echo": True}, {}, True),
        ({"echo": False, "max_tokens": 3}, {"max_tokens": 3}, True),
        ({"echo": True, "logprobs": 2}, {"logprobs": 2, "prompt_logprobs": 2}, True),
        # lm-eval's loglikelihood request: the prompt scored, one token after it.
        ({"echo": True, "logprobs": 1, "max_tokens": 1},
         {"logprobs": 1, "prompt_logprobs": 1, "max_tokens": 1}, True),
        # Nothing generated: the job makes one token, which the answer leaves out.
        ({"echo": True, "logprobs": 0, "max_tokens": 0},
         {"logprobs": 0, "prompt_logprobs": 0, "max_tokens": 1}, False),
        ({"echo": True, "max_tokens": 0}, {"max_tokens": 1}, False),
    ],
)  # fmt: skip
def test_echo_asks_for_the_prompts_own_logprobs(
    body: dict[str, Any], stored: dict[str, Any], generated: bool
) -> None:
    asked = parse_request("completions", {"model": "m", "prompt": "the cat", **body})
    assert asked.input == {"prompt": "the cat", **stored}
    assert asked.echo == bool(body.get("echo")) and asked.generated == generated
    assert asked.echo_of(asked.input) == (Echo("the cat", generated) if asked.echo else None)


PROMPT_LOGPROBS = [
    {"token": 1, "text": "the", "logprob": None, "top_logprobs": []},
    {"token": 5, "text": " cat", "logprob": -2.5, "top_logprobs": [
        {"token": 6, "text": " dog", "logprob": -1.5}]},
]  # fmt: skip


def test_an_echoed_answer_puts_the_prompt_before_the_completion() -> None:
    output = {**OUTPUT, "logprobs": LOGPROBS, "prompt_logprobs": PROMPT_LOGPROBS}
    echoed = completion_object("completions", JOB, 1, "m", output, Echo("the cat"))
    choice = echoed["choices"][0]
    assert choice["text"] == "the cathello"
    assert choice["logprobs"] == {
        "tokens": ["the", " cat", "hel", "lo"],
        "token_logprobs": [None, -2.5, -0.5, -0.125],
        "top_logprobs": [None, {" dog": -1.5, " cat": -2.5}, {"hel": -0.5, "\ufffd": -1.25},
                         {"lo": -0.125}],
        "text_offset": [0, 3, 7, 10],
    }  # fmt: skip
    assert echoed["usage"] == OUTPUT["usage"]
    scored = completion_object("completions", JOB, 1, "m", output, Echo("the cat", False))
    choice = scored["choices"][0]
    assert choice["text"] == "the cat"
    assert choice["logprobs"]["tokens"] == ["the", " cat"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.5]
    assert scored["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}
    # Without logprobs asked, the text alone.
    plain = completion_object("completions", JOB, 1, "m", OUTPUT, Echo("the cat"))
    assert plain["choices"][0]["text"] == "the cathello"
    assert plain["choices"][0]["logprobs"] is None


def test_n_choices_are_n_jobs_each_seeded_after_the_first() -> None:
    asked = parse_request("completions", {"model": "m", "prompt": "a", "n": 3, "seed": 7})
    assert asked.n == 3
    assert [asked.choice_input(i)["seed"] for i in range(3)] == [7, 8, 9]
    assert asked.choice_input(0) is asked.input  # the first choice is the request's own
    unseeded = parse_request("chat", {"model": "m", "messages": MESSAGES, "n": 2})
    assert "seed" not in unseeded.choice_input(1)  # each job draws its own from its id
    assert parse_request("chat", {"model": "m", "messages": MESSAGES}).n == 1


def test_n_outputs_are_one_completion_of_n_choices_with_the_prompt_counted_once() -> None:
    second = {**OUTPUT, "text": "bye", "finish_reason": "length",
              "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}}  # fmt: skip
    both = completion_object("chat", JOB, 1, "m", [OUTPUT, second], n=2)
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in both["choices"]] == ["hello", "bye"]
    assert [c["finish_reason"] for c in both["choices"]] == ["stop", "length"]
    assert both["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    assert chunk_object("completions", JOB, 1, "m", text="x", index=2)["choices"][0]["index"] == 2


def test_a_list_of_prompts_is_a_choice_each_and_token_ids_are_a_prompt() -> None:
    asked = parse_request(
        "completions", {"model": "m", "prompt": ["the cat", "a dog"], "n": 2, "seed": 5}
    )
    assert (asked.choices, asked.prompts) == (4, ("the cat", "a dog"))
    inputs = [asked.choice_input(i) for i in range(4)]
    assert [i["prompt"] for i in inputs] == ["the cat", "the cat", "a dog", "a dog"]
    assert [i["seed"] for i in inputs] == [5, 6, 5, 6]
    ids = parse_request("completions", {"model": "m", "prompt": [3, 1, 4]})
    assert ids.input["prompt"] == [3, 1, 4] and ids.choices == 1
    lists = parse_request("completions", {"model": "m", "prompt": [[3, 1], [4]]})
    assert lists.prompts == ([3, 1], [4]) and lists.input["prompt"] == [3, 1]
    # Each prompt's tokens counted once: two prompts, one choice each.
    two = completion_object("completions", JOB, 1, "m", [OUTPUT, OUTPUT])
    assert two["usage"] == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}
