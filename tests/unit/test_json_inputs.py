"""A JSON input is checked by its schema compiled (jsonschema-rs), and jsonschema's own
validator explains a failure: the two must agree on every value, or an input one refuses
would be taken by the other."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from core.models.inputs import InputError, JsonSpec
from core.models.repository import CostConfig

SIM_SCHEMA = tomllib.loads(
    (Path(__file__).resolve().parents[2] / "models" / "sim" / "model.toml").read_text()
)["input"]["schema"]

# A schema using what a model's input schema may: every keyword family jsonschema-rs
# implements apart from references.
RICH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["a"],
    "additionalProperties": {"type": ["integer", "null"]},
    "properties": {
        "a": {"type": "integer", "minimum": -5, "exclusiveMaximum": 2**40},
        "b": {"type": "number", "multipleOf": 0.5},
        "c": {"type": "string", "minLength": 2, "maxLength": 4, "pattern": "^[a-zé]+$"},
        "d": {
            "type": "array",
            "items": {"enum": [1, "x", None, True]},
            "minItems": 1,
            "uniqueItems": True,
        },
        "e": {"anyOf": [{"type": "boolean"}, {"const": {"k": [1, 2]}}]},
        "f": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
        "g": {
            "type": "object",
            "properties": {"a": {"type": "string", "format": "email"}},
            "propertyNames": {"maxLength": 2},
            "maxProperties": 2,
        },
        "h": {"not": {"type": "string"}, "if": {"type": "integer"}, "then": {"minimum": 0}},
    },
}

KEYS = st.sampled_from(["a", "b", "c", "d", "e", "f", "g", "h", "k", "cost", "tag", "fail", "zz"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-6, max_value=4100)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.5, 1.0, 2.0, -0.5, 1e300])
    | st.text(max_size=6)
    | st.sampled_from(["ab", "abé", "abcde", "x", "é" * 4, "a@b.c"])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=12,
)


def spec(schema: dict[str, Any]) -> JsonSpec:
    return JsonSpec(schema=schema, cost=CostConfig(function="constant"))


@pytest.mark.parametrize("schema", [SIM_SCHEMA, RICH_SCHEMA], ids=["sim", "rich"])
@settings(max_examples=1500, deadline=None)
@given(value=VALUES)
def test_the_compiled_schema_and_jsonschema_agree_on_every_value(
    schema: dict[str, Any], value: Any
) -> None:
    checked = spec(schema)
    assert checked._fast is not None  # the compiled path is the one under test
    assert checked.valid(value) == Draft202012Validator(schema).is_valid(value)


def test_a_failure_is_explained_in_jsonschemas_words() -> None:
    checked = spec(SIM_SCHEMA)
    with pytest.raises(InputError) as refused:
        checked.validate({"cost": 0})
    assert (refused.value.field, refused.value.message) == (
        "input.cost",
        "must be between 1 and 4096",
    )
    with pytest.raises(InputError) as refused:
        checked.validate({"cost": 2, "colour": "red"})
    assert refused.value.field == "input.colour"
    assert checked.validate({"cost": 3}).cost == 1  # the constant cost of this spec


def test_a_schema_with_a_reference_it_cannot_fetch_is_checked_by_jsonschema_alone() -> None:
    checked = spec(
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/elsewhere.json"}}}
    )
    assert checked._fast is None
    assert checked.valid({"b": 1})
