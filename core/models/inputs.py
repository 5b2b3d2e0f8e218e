"""Input kinds: how the API checks one job's input and prices it, without torch.

A model's ``[input]`` and ``[cost]`` tables (core.models.repository) choose one of
these (``generation``'s is in core.models.generation; core.models.catalog's
``input_spec`` picks). Each check raises
:class:`InputError` naming the field, before anything is stored; the cost is
what the scheduler budgets a batch in (tokens, pixels, a member of the input,
or a constant).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from core.models.repository import CostConfig


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


class _Tokenizers:
    """Tokenizers by file, loaded once per process on first use."""

    _lock = threading.Lock()
    _loaded: dict[Path, Any] = {}  # noqa: RUF012 (shared by design: one per process)

    @classmethod
    def get(cls, path: Path) -> Any:
        with cls._lock:
            tokenizer = cls._loaded.get(path)
            if tokenizer is None:
                from tokenizers import Tokenizer

                tokenizer = Tokenizer.from_file(str(path))
                tokenizer.no_truncation()
                tokenizer.no_padding()
                cls._loaded[path] = tokenizer
            return tokenizer


def load_tokenizer(path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` of a tokenizer.json, loaded once per process."""
    return _Tokenizers.get(path)


def count_tokens(text: str, tokenizer: Path) -> int:
    """Token count with the special tokens the tokenizer adds, before any truncation."""
    return len(_Tokenizers.get(tokenizer).encode(text).ids)


@dataclass(frozen=True)
class TextSpec:
    """A string; priced in tokens of the model's own tokenizer (or 1 per input)."""

    kind: ClassVar[str] = "text"

    name: str
    max_chars: int
    max_tokens: int | None
    overlength: str  # "truncate" | "refuse"
    tokenizer: Path | None
    cost: CostConfig

    @property
    def input_schema(self) -> dict[str, Any]:
        tokens = (
            f"; at most {self.max_tokens} tokens are used (policy for longer texts: "
            f"{self.overlength})"
            if self.max_tokens
            else ""
        )
        return {
            "type": "string",
            "minLength": 1,
            "maxLength": self.max_chars,
            "description": f"Text{tokens}.",
        }

    def validate(self, value: Any) -> Validated:
        if not isinstance(value, str):
            raise InputError("input", f"must be a string, got {json_type(value)}")
        if not value.strip():
            raise InputError("input", "must not be empty or only whitespace")
        if len(value) > self.max_chars:
            raise InputError("input", f"is {len(value)} characters; the limit is {self.max_chars}")
        if self.cost.function != "tokens" or self.tokenizer is None:
            return Validated(input=value, cost=self.cost.value)
        tokens = count_tokens(value, self.tokenizer)
        if self.max_tokens and tokens > self.max_tokens:
            if self.overlength == "refuse":
                raise InputError(
                    "input", f"is {tokens} tokens; {self.name} takes at most {self.max_tokens}"
                )
            tokens = self.max_tokens
        return Validated(input=value, cost=tokens)


JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class ImageSpec:
    """An encoded image (base64 JPEG or PNG); its header is checked, never decoded, here."""

    kind: ClassVar[str] = "image"

    image_size: int
    max_image_bytes: int
    max_pixels: int
    cost: CostConfig

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
            raise InputError("input", f"must be a base64 string, got {json_type(value)}")
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
        if self.cost.function == "constant":
            return Validated(input=value, cost=self.cost.value)
        # The pixels the model computes on: every image is resized to one square.
        return Validated(input=value, cost=self.image_size * self.image_size)


@dataclass(frozen=True)
class JsonSpec:
    """A JSON value checked against the model's JSON Schema; priced by a member or a constant."""

    kind: ClassVar[str] = "json"

    schema: Mapping[str, Any]
    cost: CostConfig
    _validator: Any = field(default=None, compare=False, repr=False)

    _fast: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        from jsonschema import Draft202012Validator

        object.__setattr__(self, "_validator", Draft202012Validator(dict(self.schema)))
        object.__setattr__(self, "_fast", _compiled(self.schema))

    @property
    def input_schema(self) -> dict[str, Any]:
        return dict(self.schema)

    def valid(self, value: Any) -> bool:
        """Whether ``value`` meets the schema, by the compiled validator where there is one
        (about 0.3 µs for a small object, against 9 µs by jsonschema's)."""
        if self._fast is not None:
            try:
                return bool(self._fast.is_valid(value))
            except Exception:  # a value it cannot take (an integer past 64 bits): decide below
                pass
        return bool(self._validator.is_valid(value))

    def validate(self, value: Any) -> Validated:
        # Checked by the compiled validator; jsonschema, slower, says what is wrong with
        # an input that fails, in the words of the messages below.
        errors = (
            []
            if self.valid(value)
            # The error nearest the input's root, so the message names the member at fault.
            else sorted(self._validator.iter_errors(value), key=lambda e: (len(e.path), e.message))
        )
        if errors:
            error = errors[0]
            where = "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path
            )
            if error.validator == "required" and isinstance(error.instance, dict):
                missing = [m for m in error.validator_value if m not in error.instance]
                if missing:
                    raise InputError(f"input{where}.{missing[0]}", "is missing")
            if error.validator == "additionalProperties" and isinstance(error.instance, dict):
                allowed = set(error.schema.get("properties", {}))
                extra = sorted(set(error.instance) - allowed)
                if extra:
                    raise InputError(f"input{where}.{extra[0]}", "is not a field of this input")
            raise InputError(f"input{where}", _schema_message(error))
        if self.cost.function != "field":
            return Validated(input=value, cost=self.cost.value)
        member = self.cost.field or ""
        cost = value.get(member) if isinstance(value, dict) else None
        if isinstance(cost, bool) or not isinstance(cost, int):
            raise InputError(f"input.{member}", f"must be an integer, got {json_type(cost)}")
        limit = self.cost.max or 4096
        if not 1 <= cost <= limit:
            raise InputError(f"input.{member}", f"must be between 1 and {limit}")
        return Validated(input=value, cost=cost)


def _compiled(schema: Mapping[str, Any]) -> Any:
    """The schema as jsonschema-rs compiles it (Draft 2020-12, formats as annotations and
    no reference fetched, as jsonschema's own validator reads it), or None for a schema it
    does not take: jsonschema's alone checks those."""
    import jsonschema_rs

    def no_retrieval(uri: str) -> Any:
        raise ValueError(f"{uri}: references are not fetched")

    try:
        return jsonschema_rs.Draft202012Validator(
            dict(schema), validate_formats=False, retriever=no_retrieval
        )
    except Exception:
        return None


def _schema_message(error: Any) -> str:
    """jsonschema's message, said of the field rather than of its value."""
    kind = error.validator
    if kind == "type":
        wanted = error.validator_value
        wanted = " or ".join(wanted) if isinstance(wanted, list) else wanted
        return f"must be {_article(wanted)} {wanted}, got {json_type(error.instance)}"
    if kind == "required":
        return error.message.replace("is a required property", "is missing")
    if kind in ("minimum", "maximum"):
        low, high = error.schema.get("minimum"), error.schema.get("maximum")
        if low is not None and high is not None:
            return f"must be between {low} and {high}"
        return f"must be at least {low}" if kind == "minimum" else f"must be at most {high}"
    if kind in ("exclusiveMinimum", "exclusiveMaximum"):
        bound = "above" if kind == "exclusiveMinimum" else "below"
        return f"must be {bound} {error.validator_value}"
    if kind == "enum":
        return f"must be one of {', '.join(map(repr, error.validator_value))}"
    return str(error.message)


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


@dataclass(frozen=True)
class TensorInputSpec:
    """Named tensors as nested JSON arrays, each of a declared per-item shape."""

    kind: ClassVar[str] = "tensor"

    tensors: tuple[Any, ...]
    cost: CostConfig

    @property
    def input_schema(self) -> dict[str, Any]:
        if len(self.tensors) == 1:
            return _array_schema(self.tensors[0].shape, self.tensors[0].dtype)
        return {
            "type": "object",
            "properties": {t.name: _array_schema(t.shape, t.dtype) for t in self.tensors},
            "required": [t.name for t in self.tensors],
            "additionalProperties": False,
        }

    def validate(self, value: Any) -> Validated:
        if len(self.tensors) == 1:
            _check_array(value, self.tensors[0].shape, self.tensors[0].dtype, "input")
            return Validated(input=value, cost=self._cost())
        if not isinstance(value, dict):
            raise InputError("input", f"must be an object of named tensors, got {json_type(value)}")
        for tensor in self.tensors:
            if tensor.name not in value:
                raise InputError(f"input.{tensor.name}", "is missing")
            _check_array(value[tensor.name], tensor.shape, tensor.dtype, f"input.{tensor.name}")
        extra = sorted(set(value) - {t.name for t in self.tensors})
        if extra:
            raise InputError(f"input.{extra[0]}", "is not an input tensor of this model")
        return Validated(input=value, cost=self._cost())

    def _cost(self) -> int:
        if self.cost.function == "constant":
            return self.cost.value
        return sum(math.prod(t.shape) for t in self.tensors)


def _array_schema(shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "boolean" if dtype == "bool" else "number"}
    if dtype.startswith("int"):
        item = {"type": "integer"}
    for size in reversed(shape):
        item = {"type": "array", "minItems": size, "maxItems": size, "items": item}
    return item


def _check_array(value: Any, shape: tuple[int, ...], dtype: str, where: str) -> None:
    """Checks nesting, sizes and element types iteratively (no recursion on hostile depth)."""
    level: list[Any] = [value]
    for axis, size in enumerate(shape):
        following: list[Any] = []
        for item in level:
            if not isinstance(item, list):
                raise InputError(
                    where, f"must be an array of shape {list(shape)}; axis {axis} is not an array"
                )
            if len(item) != size:
                raise InputError(
                    where,
                    f"must be an array of shape {list(shape)}; axis {axis} has {len(item)} items",
                )
            following.extend(item)
        level = following
    for item in level:
        if dtype == "bool":
            ok = isinstance(item, bool)
        elif dtype.startswith("int"):
            ok = isinstance(item, int) and not isinstance(item, bool)
        else:
            ok = (
                isinstance(item, int | float) and not isinstance(item, bool) and math.isfinite(item)
            )
        if not ok:
            want = {"bool": "booleans"}.get(
                dtype, "integers" if dtype.startswith("int") else "finite numbers"
            )
            raise InputError(where, f"must hold {want} ({dtype}), found {json_type(item)}")


def json_type(value: Any) -> str:
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
