"""Input validation and pricing by the catalog's specs of the shipped models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from backends.catalog import build_catalog
from core.config.settings import Settings
from core.models.catalog import InputError, ModelSpec, Validated
from core.models.inputs import TextSpec
from core.models.repository import CostConfig
from tests.models import REPOSITORY, minilm_files

REPO_ROOT = Path(__file__).resolve().parents[2]


def independent_count(text: str) -> int:
    """The token count, from a tokenizer loaded here, not the catalog's."""
    tokenizer = Tokenizer.from_file(str(minilm_files() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return len(tokenizer.encode(text).ids)


def minilm(
    max_tokens: int = 256, max_chars: int = 20_000, overlength: str = "truncate"
) -> TextSpec:
    return TextSpec(
        name="minilm",
        max_chars=max_chars,
        max_tokens=max_tokens,
        overlength=overlength,
        tokenizer=minilm_files() / "tokenizer.json",
        cost=CostConfig("tokens"),
    )


def shipped(model: str, **parameters: Any) -> ModelSpec:
    """The API's spec of a shipped model, [input]/[parameters] values replaced."""
    settings = Settings(
        model_repository=REPOSITORY, models=model, model_parameters={model: parameters}
    )
    return build_catalog(settings)[model]


def test_the_shipped_minilm_is_priced_as_this_spec() -> None:
    text = "one two three four five six seven eight nine ten " * 40  # 402 tokens
    assert shipped("minilm").validate(text) == minilm().validate(text) == Validated(text, 256)
    with pytest.raises(InputError, match="402 tokens; minilm takes at most 256"):
        shipped("minilm", overlength="refuse").validate(text)


# --- text inputs priced in tokens (minilm) -----------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "got null"),
        (42, "got number"),
        (1.5, "got number"),
        (True, "got boolean"),
        (["hello"], "got array"),
        ({"text": "hello"}, "got object"),
        (b"hello", "must be a string"),
        ("", "empty"),
        (" ", "empty"),
        ("\t\n  \r\n", "empty"),
    ],
)
def test_minilm_rejects_non_text(value: Any, message: str) -> None:
    with pytest.raises(InputError, match=message) as info:
        minilm().validate(value)
    assert info.value.field == "input"


@pytest.mark.parametrize(
    ("max_chars", "length", "ok"),
    [(10, 10, True), (10, 11, False), (1, 1, True), (1, 2, False)],
)
def test_minilm_character_limit(max_chars: int, length: int, ok: bool) -> None:
    spec = minilm(max_chars=max_chars, overlength="refuse", max_tokens=512)
    text = "a" * length
    if ok:
        assert spec.validate(text).input == text
    else:
        with pytest.raises(
            InputError, match=f"{length} characters; the limit is {max_chars}"
        ) as info:
            spec.validate(text)
        assert info.value.field == "input"


def test_hello_world_is_four_tokens() -> None:
    # [CLS] hello world [SEP]
    assert minilm().validate("hello world") == Validated(input="hello world", cost=4)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "The quick brown fox jumps over the lazy dog.",
        "Tokenisation splits unfamiliar words: antidisestablishmentarianism!",
        "  leading and trailing spaces  ",
        "日本語のテキストも数えます",
    ],
)
def test_minilm_cost_is_the_real_token_count(text: str) -> None:
    expected = independent_count(text)
    assert minilm(max_tokens=512).validate(text).cost == expected


def test_minilm_counts_beyond_the_tokenizer_files_own_truncation() -> None:
    # tokenizer.json ships with truncation at 128; the count must ignore it.
    text = " ".join(["word"] * 300)
    expected = independent_count(text)
    assert expected == 302
    assert minilm(max_tokens=512).validate(text).cost == 302


@pytest.mark.parametrize(
    ("max_tokens", "overlength", "expected_cost"),
    [
        (8, "truncate", 8),  # capped at max_tokens
        (12, "truncate", 12),  # exactly fits
        (12, "refuse", 12),
        (64, "truncate", 12),
        (64, "refuse", 12),
    ],
)
def test_minilm_overlength_policy_accepts(
    max_tokens: int, overlength: str, expected_cost: int
) -> None:
    text = "one two three four five six seven eight nine ten"  # 10 words, 12 tokens
    assert independent_count(text) == 12
    result = minilm(max_tokens=max_tokens, overlength=overlength).validate(text)
    assert result.cost == expected_cost
    assert result.input == text  # the text itself is not cut here


@pytest.mark.parametrize("max_tokens", [8, 11])
def test_minilm_overlength_refuse(max_tokens: int) -> None:
    text = "one two three four five six seven eight nine ten"
    with pytest.raises(InputError, match=f"12 tokens; minilm takes at most {max_tokens}") as info:
        minilm(max_tokens=max_tokens, overlength="refuse").validate(text)
    assert info.value.field == "input"


def test_the_catalog_checks_inputs_without_importing_torch() -> None:
    # What the API does: the repository checked with every backend, each input priced.
    code = (
        "import sys; from backends.catalog import build_catalog; "
        "from core.config.settings import Settings; "
        "c = build_catalog(Settings(models='minilm,resnet50,sim', "
        "model_parameters={'resnet50': {'random_weights': True}})); "
        "assert c['minilm'].validate('hello world').cost == 4; "
        "assert c['sim'].validate({'cost': 3}).cost == 3; "
        "loaded = [m for m in ('torch', 'transformers', 'onnxruntime') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


# --- JSON inputs priced by a member (sim) -------------------------------------


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        (None, "input", "must be an object, got null"),
        (3, "input", "must be an object, got number"),
        ("cost", "input", "must be an object, got string"),
        ([{"cost": 1}], "input", "must be an object, got array"),
        ({"cost": 1, "colour": "red"}, "input.colour", "not a field"),
        ({"cost": 1, "b": 1, "a": 2}, "input.a", "not a field"),  # the first, sorted
        ({}, "input.cost", "is missing"),
        ({"fail": True}, "input.cost", "is missing"),
        ({"cost": True}, "input.cost", "must be an integer, got boolean"),
        ({"cost": False}, "input.cost", "must be an integer, got boolean"),
        ({"cost": 2.0}, "input.cost", "must be an integer, got number"),
        ({"cost": "3"}, "input.cost", "must be an integer, got string"),
        ({"cost": 0}, "input.cost", "between 1 and 4096"),
        ({"cost": -1}, "input.cost", "between 1 and 4096"),
        ({"cost": 4097}, "input.cost", "between 1 and 4096"),
        ({"cost": 1, "fail": 1}, "input.fail", "must be a boolean, got number"),
        ({"cost": 1, "fail": "yes"}, "input.fail", "must be a boolean, got string"),
        ({"cost": 1, "fail": None}, "input.fail", "must be a boolean, got null"),
    ],
)
def test_sim_rejects(value: Any, field: str, message: str) -> None:
    with pytest.raises(InputError, match=message) as info:
        shipped("sim").validate(value)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"cost": 1}, Validated(input={"cost": 1}, cost=1)),
        ({"cost": 4096}, Validated(input={"cost": 4096}, cost=4096)),
        ({"cost": 7, "fail": True}, Validated(input={"cost": 7, "fail": True}, cost=7)),
        ({"cost": 7, "fail": False}, Validated(input={"cost": 7, "fail": False}, cost=7)),
    ],
)
def test_sim_accepts(value: dict[str, Any], expected: Validated) -> None:
    # The input is stored as sent: a JSON model's check does not rewrite it.
    assert shipped("sim").validate(value) == expected


def test_input_error_carries_field_and_message() -> None:
    error = InputError("input.cost", "must be positive")
    assert error.field == "input.cost"
    assert error.message == "must be positive"
    assert str(error) == "input.cost: must be positive"
    assert isinstance(error, ValueError)


def test_sim_crash_inputs_only_when_enabled() -> None:
    with pytest.raises(InputError) as refused:
        shipped("sim").validate({"cost": 1, "crash": True})
    assert refused.value.field == "input.crash"
    assert "crash" not in shipped("sim").input_schema["properties"]

    enabled = shipped("sim", crash_enabled=True)
    assert enabled.validate({"cost": 1, "crash": True}).input == {"cost": 1, "crash": True}
    assert "crash" in enabled.input_schema["properties"]
    with pytest.raises(InputError, match="boolean"):
        enabled.validate({"cost": 1, "crash": "yes"})


def test_fail_inputs_only_when_enabled() -> None:
    assert "fail" in shipped("sim").input_schema["properties"]
    with pytest.raises(InputError) as refused:
        shipped("sim", fail_enabled=False).validate({"cost": 1, "fail": True})
    assert refused.value.field == "input.fail"
