"""Vectors as OpenAI's embeddings API gives them: cut to ``dimensions``, float or base64."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any, Literal

from core.models.repository import EmbeddingsConfig

EncodingFormat = Literal["float", "base64"]


def as_vector(output: Any) -> list[float] | None:
    """A model's output as a list of floats; None if it is not a vector."""
    if not isinstance(output, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in output
    ):
        return None
    return [float(x) for x in output]


def cut(vector: list[float], dimensions: int | None) -> list[float]:
    """The first ``dimensions`` values, normalised again (OpenAI's shortened embeddings)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def encoded(vector: list[float], encoding_format: EncodingFormat) -> list[float] | str:
    """``base64``: the little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def dimensions_problem(config: EmbeddingsConfig, model: str, dimensions: int) -> str | None:
    """Why a model cannot give vectors of ``dimensions`` (None: it can)."""
    if dimensions == config.dimensions or (dimensions < config.dimensions and config.truncatable):
        return None
    allowed = f"at most {config.dimensions}" if config.truncatable else f"only {config.dimensions}"
    return f"{model!r} gives vectors of {allowed}"
