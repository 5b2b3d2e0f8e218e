"""The catalog: what the API knows of each model it takes jobs for.

Built from the model repository (core.models.repository) by backends.catalog; a
spec checks an input and prices it without torch (``input_spec`` picks a model's
from core.models.inputs or core.models.generation), and says which versions the
model has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.models.generation import generation_spec
from core.models.inputs import (
    ImageSpec,
    InputError,
    JsonSpec,
    TensorInputSpec,
    TextSpec,
    Validated,
)
from core.models.repository import EmbeddingsConfig, InputConfig, ModelConfig

__all__ = [
    "InputError",
    "ModelSpec",
    "Validated",
    "input_spec",
    "nesting_problem",
    "text_problem",
]


def input_spec(model: ModelConfig) -> Any:
    """The API's check and price for ``model``'s inputs, from its [input] and [cost]."""
    config: InputConfig = model.input
    if config.kind == "text":
        return TextSpec(
            name=model.name,
            max_chars=config.max_chars,
            max_tokens=config.max_tokens,
            overlength=config.overlength,
            tokenizer=model.tokenizer_path(),
            cost=model.cost,
        )
    if config.kind == "image":
        return ImageSpec(config.image_size, config.max_image_bytes, config.max_pixels, model.cost)
    if config.kind == "json":
        return JsonSpec(config.schema or {}, model.cost)
    if config.kind == "generation":
        return generation_spec(model)
    return TensorInputSpec(config.tensors, model.cost)


@dataclass(frozen=True)
class ModelSpec:
    """One model as the API sees it: its input check and its versions."""

    name: str
    description: str
    backend: str
    active_version: int
    versions: tuple[int, ...]
    max_batch_size: int
    input: Any  # a core.models.inputs spec: validate(value) -> Validated, input_schema
    embeddings: EmbeddingsConfig | None = None  # served on POST /v1/embeddings

    @property
    def input_schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = self.input.input_schema
        return schema

    def validate(self, value: Any) -> Validated:
        validated: Validated = self.input.validate(value)
        return validated


# Deepest nesting of arrays and objects a stored value may have: well inside what
# the JSON serializers that return it can write (pydantic's stops at a few hundred).
# FERRY_MAX_JSON_DEPTH may lower it.
MAX_JSON_DEPTH = 64


def text_problem(value: Any, depth: int = 0, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """What in this JSON value cannot be stored and returned (None: nothing).

    PostgreSQL refuses NUL in text, and no UTF-8 column can hold an unpaired
    surrogate (JSON's "\\ud800" decodes to one). Nesting past ``max_depth``
    (at most MAX_JSON_DEPTH) would be stored but could not be written back out.
    """
    if isinstance(value, (dict, list)) and depth >= max_depth:
        return f"more than {max_depth} levels of nesting"
    if isinstance(value, str):
        if "\x00" in value:
            return "NUL characters"
        if any("\ud800" <= c <= "\udfff" for c in value):
            return "unpaired surrogates (not valid Unicode)"
        return None
    if isinstance(value, dict):
        items: Any = (x for pair in value.items() for x in pair)
    elif isinstance(value, list):
        items = iter(value)
    else:
        return None
    for item in items:
        problem = text_problem(item, depth + 1, max_depth)
        if problem:
            return problem
    return None


def nesting_problem(value: Any, max_depth: int) -> str | None:
    """Whether arrays and objects nest past ``max_depth`` (containers only; no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= max_depth:
            return f"more than {max_depth} levels of nesting"
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return None
