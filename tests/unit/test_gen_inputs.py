"""Generation inputs: model.toml's [input] kind "generation", and a job's input checked and priced.

The model folders are written here (tests.causal_lm_files): a word-level
tokenizer whose counts are easy to predict, a config.json, and a ChatML
template. Nothing needs the causal-lm backend itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from core.models.catalog import input_spec
from core.models.generation import GenerationSpec, prompt_token_ids
from core.models.inputs import InputError
from core.models.reader import load_repository
from core.models.repository import Repository
from tests.causal_lm_files import CHATML, LLAMA2, write_model

BOS = 0  # the tokenizer's <s>


def read(root: Path) -> Repository:
    return load_repository(root, environ={})


def spec_of(tmp_path: Path, input_table: str = "", **version: Any) -> GenerationSpec:
    root = tmp_path / "models"
    write_model(root, input_table=input_table, **version)
    repository = read(root)
    assert repository.problems == ()
    spec = input_spec(repository["tiny-lm"])
    assert isinstance(spec, GenerationSpec)
    return spec


def problems(tmp_path: Path, input_table: str = "", cost: str = "", **version: Any) -> list[str]:
    root = tmp_path / "models"
    folder = write_model(root, input_table=input_table, **version)
    if cost:
        toml = (folder / "model.toml").read_text().replace('function = "tokens"', cost)
        (folder / "model.toml").write_text(toml)
    return [str(p) for p in read(root).problems]


@pytest.fixture
def spec(tmp_path: Path) -> GenerationSpec:
    return spec_of(tmp_path)


# model.toml


def test_the_defaults_come_from_the_versions_files(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_model(root)
    model = read(root)["tiny-lm"]
    assert model.input.kind == "generation"
    assert (model.input.max_chars, model.input.default_max_tokens) == (100_000, 256)
    assert model.input.context_tokens is None and model.input.chat_template is None
    spec = input_spec(model)
    assert spec.context_tokens == 64  # config.json's max_position_embeddings
    assert spec.chat is not None and spec.chat.source.name == "tokenizer_config.json"
    assert spec.kind == "generation"


def test_gpt2_names_its_context_n_positions(tmp_path: Path) -> None:
    assert spec_of(tmp_path, context_key="n_positions", context_tokens=1024).context_tokens == 1024


def test_model_toml_sets_context_max_tokens_and_template(tmp_path: Path) -> None:
    root = tmp_path / "models"
    table = (
        'context_tokens = 32\ndefault_max_tokens = 8\nmax_chars = 500\nchat_template = "c.jinja"'
    )
    folder = write_model(root, input_table=table, chat_template=None, context_tokens=None)
    (folder / "1" / "c.jinja").write_text(CHATML)
    repository = read(root)
    assert repository.problems == ()
    spec = input_spec(repository["tiny-lm"])
    assert (spec.context_tokens, spec.default_max_tokens, spec.max_chars) == (32, 8, 500)
    assert spec.chat is not None and spec.chat.source.name == "c.jinja"
    assert spec.validate({"prompt": "hello"}).input["max_tokens"] == 8


def test_without_a_template_the_model_takes_prompts_only(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, chat_template=None)
    assert spec.chat is None
    assert "messages" not in spec.input_schema["properties"]
    with pytest.raises(InputError) as refused:
        spec.validate({"messages": [{"role": "user", "content": "hello"}]})
    assert refused.value.field == "messages"
    assert "tiny-lm has no chat template" in refused.value.message
    assert spec.validate({"prompt": "hello"}).input["prompt"] == "hello"


@pytest.mark.parametrize(
    ("input_table", "cost", "version", "expected"),
    [
        (
            "",
            "",
            {"context_tokens": None},
            "models/tiny-lm/model.toml: input.context_tokens: version 1: is not set, and "
            "config.json has no max_position_embeddings (or n_positions)",
        ),
        (
            'chat_template = "chat.jinja"',
            "",
            {},
            "models/tiny-lm/model.toml: input.chat_template: version 1: chat.jinja is missing",
        ),
        (
            "",
            "",
            {"chat_template": "{% for m in messages %}"},
            "models/tiny-lm/model.toml: input.chat_template: version 1: tokenizer_config.json "
            "is not a valid template",
        ),
        (
            "",
            "",
            {"chat_template": [{"name": "tool_use", "template": "x"}]},
            "models/tiny-lm/model.toml: input.chat_template: version 1: tokenizer_config.json "
            "chat_template lists no template named 'default'",
        ),
        (
            "context_tokens = 1",
            "",
            {},
            "models/tiny-lm/model.toml: input.context_tokens: must be at least 2, got 1",
        ),
        (
            "default_max_tokens = true",
            "",
            {},
            "models/tiny-lm/model.toml: input.default_max_tokens: must be an integer, got a "
            "boolean",
        ),
        (
            "max_tokens = 10",
            "",
            {},
            "models/tiny-lm/model.toml: input.max_tokens: is not a field of generation inputs",
        ),
        (
            "chat_template = 3",
            "",
            {},
            "models/tiny-lm/model.toml: input.chat_template: must be a file name",
        ),
        (
            "",
            'function = "constant"',
            {},
            "models/tiny-lm/model.toml: cost.function: is 'constant'; generation inputs are "
            "priced in 'tokens'",
        ),
    ],
)
def test_each_problem_names_the_file_and_field(
    tmp_path: Path, input_table: str, cost: str, version: dict[str, Any], expected: str
) -> None:
    found = problems(tmp_path, input_table, cost, **version)
    assert any(p.startswith(expected) for p in found), found


def test_a_tokenizer_is_required(tmp_path: Path) -> None:
    root = tmp_path / "models"
    folder = write_model(root)
    toml = (folder / "model.toml").read_text().replace('tokenizer = "tokenizer.json"\n', "")
    (folder / "model.toml").write_text(toml)
    repository = read(root)
    assert "tiny-lm" not in repository
    assert [str(p) for p in repository.problems] == [
        "models/tiny-lm/model.toml: input.tokenizer: must name the model's tokenizer.json: "
        "the prompt's tokens are counted with it"
    ]


# A job's input


def test_a_prompt_is_normalised_with_every_default(spec: GenerationSpec) -> None:
    validated = spec.validate({"prompt": "the cat sat"})
    # <s> and three words: a prompt given as text gets the tokenizer's special tokens.
    assert validated.input == {
        "prompt": "the cat sat",
        "max_tokens": 60,  # default_max_tokens (256), capped to what the context of 64 leaves
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": [],
        "seed": None,
        "prompt_tokens": 4,
    }
    assert validated.cost == 64
    assert prompt_token_ids(validated.input, spec.tokenizer)[0] == BOS
    json.dumps(validated.input)  # stored as JSON


def test_every_member_given(spec: GenerationSpec) -> None:
    value = {
        "prompt": "hello world",
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "stop": "mat",
        "seed": 2**63 - 1,
    }
    validated = spec.validate(value)
    assert validated.input == {
        **value,
        "temperature": 0.0,
        "stop": ["mat"],
        "prompt_tokens": 3,
    }
    assert isinstance(validated.input["temperature"], float)
    assert validated.cost == 3 + 5


def test_null_is_the_same_as_absent(spec: GenerationSpec) -> None:
    given = {"prompt": "hello", "max_tokens": None, "temperature": None, "top_p": None}
    assert spec.validate(given | {"stop": None, "seed": None}) == spec.validate({"prompt": "hello"})
    nothing_asked = {"presence_penalty": None, "frequency_penalty": 0, "logit_bias": {"3": 0}}
    assert spec.validate(given | nothing_asked) == spec.validate({"prompt": "hello"})


def test_penalties_and_a_bias_are_stored_when_they_ask_for_something(
    spec: GenerationSpec,
) -> None:
    value = {
        "prompt": "hello",
        "presence_penalty": 0.5,
        "frequency_penalty": -2,
        "logit_bias": {"3": 5, "0": -100, "7": 0},
    }
    found = spec.validate(value).input
    assert (found["presence_penalty"], found["frequency_penalty"]) == (0.5, -2.0)
    assert found["logit_bias"] == {"3": 5.0, "0": -100.0}  # a bias of 0 asks for nothing
    assert isinstance(found["frequency_penalty"], float)
    json.dumps(found)


def test_a_prompt_of_token_ids_is_taken_as_it_is(spec: GenerationSpec) -> None:
    text = spec.validate({"prompt": "the cat"}).input
    ids = prompt_token_ids(text, spec.tokenizer)
    assert ids[0] == BOS  # a text gets the tokenizer's special tokens
    given = spec.validate({"prompt": ids[1:], "max_tokens": 2})
    assert given.input["prompt_ids"] == ids[1:]  # ids get none added
    assert prompt_token_ids(given.input, spec.tokenizer) == ids[1:]
    assert given.input["prompt_tokens"] == len(ids) - 1 and given.cost == len(ids) + 1
    assert "cat" in given.input["prompt"]  # the text they decode to, for an echo
    with pytest.raises(InputError) as refused:
        spec.validate({"prompt": [1, 10**6]})
    assert refused.value.field == "prompt[1]"
    with pytest.raises(InputError) as empty:
        spec.validate({"prompt": []})
    assert empty.value.field == "prompt"


@pytest.mark.parametrize("asked", [0, 3, 20])
def test_logprobs_are_stored_as_asked(spec: GenerationSpec, asked: int) -> None:
    assert spec.validate({"prompt": "hello", "logprobs": asked}).input["logprobs"] == asked
    assert "logprobs" not in spec.validate({"prompt": "hello", "logprobs": None}).input
    scored = spec.validate({"prompt": "hello", "prompt_logprobs": asked}).input
    assert scored["prompt_logprobs"] == asked and "logprobs" not in scored


def test_messages_are_rendered_by_the_chat_template(spec: GenerationSpec) -> None:
    messages = [
        {"role": "system", "content": "hello"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat"},
        {"role": "user", "content": "on the mat"},
    ]
    validated = spec.validate({"messages": messages, "max_tokens": 4})
    prompt = (
        "<|im_start|>system\nhello<|im_end|>\n<|im_start|>user\nthe cat<|im_end|>\n"
        "<|im_start|>assistant\nsat<|im_end|>\n<|im_start|>user\non the mat<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert validated.input["prompt"] == prompt
    assert validated.input["messages"] == messages
    ids = prompt_token_ids(validated.input, spec.tokenizer)
    # The template writes its own special tokens: none is added in front.
    assert ids[0] != BOS and ids.count(BOS) == 0
    # Each turn: <|im_start|>, the role, its words, <|im_end|>; then <|im_start|> assistant.
    assert validated.input["prompt_tokens"] == len(ids) == 4 * 3 + 1 + 2 + 1 + 3 + 2
    assert validated.cost == len(ids) + 4


def test_the_count_is_what_the_worker_gets(spec: GenerationSpec) -> None:
    for value in (
        {"prompt": "the cat sat on the mat"},
        {"messages": [{"role": "user", "content": "x y"}]},
    ):
        validated = spec.validate(value)
        ids = prompt_token_ids(validated.input, spec.tokenizer)
        assert validated.input["prompt_tokens"] == len(ids)


def test_a_template_that_refuses_a_conversation(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, chat_template=LLAMA2)
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InputError) as refused:
        spec.validate({"messages": twice})
    assert refused.value.field == "messages"
    assert "roles must alternate" in refused.value.message
    alone = spec.validate({"messages": twice[:1]}).input
    assert alone["prompt"] == "<s>[INST] a [/INST]"


def test_a_prompt_longer_than_the_context(spec: GenerationSpec) -> None:
    with pytest.raises(InputError) as refused:
        spec.validate({"prompt": "cat " * 70})
    assert str(refused.value) == ("prompt: the prompt has 71 tokens, longer than the context of 64")
    with pytest.raises(InputError) as full:
        spec.validate({"prompt": "cat " * 63})
    assert full.value.field == "prompt" and "none is left to generate" in full.value.message
    assert spec.validate({"prompt": "cat " * 62}).input["max_tokens"] == 1


def test_max_tokens_beyond_what_the_context_leaves(spec: GenerationSpec) -> None:
    prompt = "cat " * 39  # 40 tokens with <s>
    assert spec.validate({"prompt": prompt, "max_tokens": 24}).cost == 64
    with pytest.raises(InputError) as refused:
        spec.validate({"prompt": prompt, "max_tokens": 5000})
    assert str(refused.value) == (
        "max_tokens: is 5000: the prompt's 40 tokens and 5000 leave no room in the model's "
        "context of 64 tokens (at most 24 here)"
    )


def test_messages_of_a_chat_longer_than_the_context(spec: GenerationSpec) -> None:
    with pytest.raises(InputError) as refused:
        spec.validate({"messages": [{"role": "user", "content": "cat " * 64}]})
    assert refused.value.field == "messages"
    assert "longer than the context of 64" in refused.value.message


def test_max_chars_counts_the_prompt_or_all_contents(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "max_chars = 10")
    assert spec.validate({"prompt": "x" * 10}).input["prompt_tokens"] == 2
    with pytest.raises(InputError, match="prompt: is 11 characters; the limit is 10"):
        spec.validate({"prompt": "x" * 11})
    five = {"role": "user", "content": "xxxxx"}
    spec.validate({"messages": [five, five]})
    with pytest.raises(
        InputError, match="messages: hold 11 characters of content together; the limit is 10"
    ):
        spec.validate({"messages": [five, five, {"role": "user", "content": "x"}]})


HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        ("hello", "input", "must be an object with prompt or messages, got string"),
        ({}, "prompt", "is missing: give prompt (a string) or messages"),
        ({"prompt": "a", "messages": HELLO}, "messages", "cannot be given with prompt"),
        ({"prompt": 3}, "prompt", "must be a string or token ids, got number"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": "a", "n": 2}, "n", "is not a field of generation inputs (prompt, messages, "),
        ({"messages": []}, "messages", "must hold at least one message"),
        ({"messages": "hello"}, "messages", "must be an array of messages, got string"),
        ({"messages": ["hello"]}, "messages[0]", "must be an object with role and content"),
        (
            {"messages": [*HELLO, {"role": "tool", "content": "42"}]},
            "messages[1].role",
            "is 'tool': tool messages are not taken",
        ),
        (
            {"messages": [{"role": "developer", "content": "x"}]},
            "messages[0].role",
            "is 'developer'; one of system, user, assistant",
        ),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role", "is number; one of"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "is missing"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "is missing"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "must not be"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
            "messages[0].content",
            "must be a string, got array",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
            "messages[0].name",
            "is not a field of a message (role, content)",
        ),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", "must be an integer of at least 1, got 0"),
        ({"prompt": "a", "max_tokens": 2.0}, "max_tokens", "must be an integer of at least 1"),
        (
            {"prompt": "a", "max_tokens": True},
            "max_tokens",
            "must be an integer of at least 1, got boolean",
        ),
        ({"prompt": "a", "temperature": True}, "temperature", "must be a number, got boolean"),
        ({"prompt": "a", "temperature": "1"}, "temperature", "must be a number, got string"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature", "must be a number"),
        ({"prompt": "a", "temperature": 2.5}, "temperature", "must be between 0 and 2"),
        ({"prompt": "a", "temperature": -0.1}, "temperature", "must be between 0 and 2"),
        ({"prompt": "a", "top_p": 0}, "top_p", "must be above 0 and at most 1, got 0.0"),
        ({"prompt": "a", "top_p": 1.01}, "top_p", "must be above 0 and at most 1"),
        ({"prompt": "a", "stop": ""}, "stop", "must not be an empty string"),
        ({"prompt": "a", "stop": 3}, "stop", "must be a string or an array of strings"),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop", "holds 5 strings; at most 4"),
        ({"prompt": "a", "stop": ["a", ""]}, "stop[1]", "must be a non-empty string"),
        ({"prompt": "a", "stop": ["a", 1]}, "stop[1]", "must be a non-empty string, got 1"),
        ({"prompt": "a", "seed": -1}, "seed", "must be an integer from 0 to 2**63 - 1, got -1"),
        ({"prompt": "a", "seed": 2**63}, "seed", "must be an integer from 0 to 2**63 - 1"),
        (
            {"prompt": "a", "seed": True},
            "seed",
            "must be an integer from 0 to 2**63 - 1, got boolean",
        ),
        ({"prompt": "a", "seed": 1.0}, "seed", "must be an integer from 0 to 2**63 - 1, got 1.0"),
        ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty", "must be between -2 and 2"),
        ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty", "must be between -2 and 2"),
        (
            {"prompt": "a", "frequency_penalty": True},
            "frequency_penalty",
            "must be a number, got boolean",
        ),
        ({"prompt": "a", "presence_penalty": "0"}, "presence_penalty", "must be a number, got"),
        ({"prompt": "a", "logit_bias": [1]}, "logit_bias", "must be an object of token ids"),
        ({"prompt": "a", "logit_bias": {"a": 1}}, "logit_bias", "has the key 'a': keys are token"),
        ({"prompt": "a", "logit_bias": {"07": 1}}, "logit_bias", "has the key '07'"),
        ({"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias", "has the key '-1'"),
        ({"prompt": "a", "logit_bias": {"3": 101}}, "logit_bias.3", "must be between -100 and"),
        ({"prompt": "a", "logit_bias": {"3": "1"}}, "logit_bias.3", "must be a number, got string"),
        ({"prompt": "a", "logit_bias": {"3": None}}, "logit_bias.3", "must be a number, got null"),
        (
            {"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}},
            "logit_bias",
            "holds 301 tokens; at most 300",
        ),
        ({"prompt": "a", "logit_bias": {"99999": 1}}, "logit_bias.99999", "is no token of tiny-lm"),
        ({"prompt": "a", "logprobs": 21}, "logprobs", "must be an integer from 0 to 20, got 21"),
        (
            {"prompt": "a", "prompt_logprobs": -1},
            "prompt_logprobs",
            "must be an integer from 0 to 20, got -1",
        ),
        (
            {"prompt": "a", "prompt_logprobs": True},
            "prompt_logprobs",
            "must be an integer from 0 to 20, got boolean",
        ),
        ({"prompt": "a", "logprobs": -1}, "logprobs", "must be an integer from 0 to 20"),
        ({"prompt": "a", "logprobs": True}, "logprobs", "must be an integer from 0 to 20, got boo"),
        ({"prompt": "a", "logprobs": 2.0}, "logprobs", "must be an integer from 0 to 20, got 2.0"),
    ],
)
def test_each_refusal_names_the_member(
    spec: GenerationSpec, value: Any, field: str, message: str
) -> None:
    with pytest.raises(InputError) as refused:
        spec.validate(value)
    assert refused.value.field == field
    assert refused.value.message.startswith(message), refused.value.message


def test_the_schema_describes_what_validate_takes(spec: GenerationSpec) -> None:
    schema = spec.input_schema
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    taken = [
        {"prompt": "hello", "max_tokens": 3, "temperature": 0, "stop": ["a"], "seed": 1},
        {"messages": HELLO, "top_p": 0.9, "stop": "x"},
        {"prompt": "a", "presence_penalty": -1, "frequency_penalty": 2, "logit_bias": {"3": -1}},
        {"prompt": "a", "logprobs": 5},
    ]
    for value in taken:
        spec.validate(value)
        assert validator.is_valid(value), value
    refused: list[Any] = [
        {},
        {"prompt": "a", "messages": HELLO},
        {"prompt": "a", "n": 1},
        {"prompt": ""},
        {"prompt": "a", "presence_penalty": 3},
        {"prompt": "a", "logit_bias": {"07": 1}},
        {"prompt": "a", "logit_bias": {"3": -101}},
        {"prompt": "a", "logprobs": 21},
    ]
    for value in refused:
        with pytest.raises(InputError):
            spec.validate(value)
        assert not validator.is_valid(value), value
    assert schema["properties"]["max_tokens"]["maximum"] == 63
