"""The settings reference, docs/settings.md, rendered from the settings themselves.

Every setting is documented once, in the docstring under its field in
:class:`core.config.settings.Settings`; this module turns the fields (name, type,
bounds, default, description, whether it can be set per model) into one table
per group. After changing a setting, regenerate the page:

    python -m core.config.reference --write

``tests/unit/test_settings_reference.py`` fails while the page is stale.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import SecretStr
from pydantic.fields import FieldInfo

from core.config.settings import PER_MODEL, Settings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
COMMAND = "python -m core.config.reference --write"

# Each group starts at its first field, in the order Settings declares them.
GROUPS = (
    ("data_dir", "Local state and connections"),
    ("model_repository", "Models"),
    ("scheduler", "Batching"),
    ("visibility_timeout_s", "Recovery and the worker's pipeline"),
    ("max_body_bytes", "The API"),
    ("celery_concurrency", "Celery"),
    ("webhook_retry_schedule_s", "Webhooks"),
    ("backfill_max_lines", "Backfills"),
    ("result_ttl_s", "Retention"),
    ("device", "Workers and GPUs"),
    ("metrics_port_base", "Metrics"),
    ("flower_host", "Flower"),
    ("log_level", "Logs"),
)

INTRO = f"""\
<!-- Generated from core/config/settings.py by `{COMMAND}`: edit the docstrings there. -->

# Settings

Every setting is an environment variable with the `FERRY_` prefix, read when a
process starts (`FERRY_API_PORT=8080 ferry api`); lists and objects are JSON.
This page is generated from the settings' own descriptions in
`core/config/settings.py`.

The settings marked *per model* can also be set for one model: in the
`[batching]` and `[memory]` tables (and `precision`) of its model.toml (see
[the model repository](model-repository.md)), which replace Ferry's defaults
but not a variable set in the environment, and in `FERRY_MODEL_SETTINGS`,
which wins over both.

A model's own `[input]` and `[parameters]` values are settings too, one
variable each: `FERRY_<MODEL>_<KEY>`, for example `FERRY_SIM_LATENCY_BASE_MS=5`
or `FERRY_MINILM_OVERLENGTH=refuse`. The key must be in the model's
model.toml, and the value is read as the type it has there;
`FERRY_MODEL_PARAMETERS` sets several at once.
"""

_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    Path: "path",
    SecretStr: "string (secret)",
}


def render() -> str:
    """The Markdown of docs/settings.md."""
    parts = [INTRO, '\n<div class="settings-reference" markdown>\n']
    for title, names in _groups():
        parts.append(f"\n## {title}\n\n")
        parts.append("| variable | default | type and meaning |\n")
        parts.append("|---|---|---|\n")
        for name in names:
            parts.append(_row(name, Settings.model_fields[name]))
    parts.append("\n</div>\n")
    return "".join(parts)


def _groups() -> Iterator[tuple[str, list[str]]]:
    fields = list(Settings.model_fields)
    starts = [(fields.index(first), title) for first, title in GROUPS if first in fields]
    missing = [first for first, _ in GROUPS if first not in fields]
    if missing or starts != sorted(starts) or starts[0][0] != 0:
        raise ValueError(
            f"GROUPS must name fields of Settings, in their order, from the first; not {missing}"
        )
    ends = [index for index, _ in starts[1:]] + [len(fields)]
    for (start, title), end in zip(starts, ends, strict=True):
        yield title, fields[start:end]


def _row(name: str, field: FieldInfo) -> str:
    kind = _kind(field) + ("; per model" if name in PER_MODEL else "")
    description = " ".join((field.description or "").split())
    cells = (f"`FERRY_{name.upper()}`", _default(field), f"*{kind}*<br>{description}")
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |\n"


def _kind(field: FieldInfo) -> str:
    """The type in words, with the bounds the field enforces."""
    kind = _type_name(field.annotation)
    low, high = _bound(field, "min_length"), _bound(field, "max_length")
    if low is not None or high is not None:
        return f"{kind}, {low or 0} to {high} entries" if high else f"{kind}, {low} or more"
    ge, gt, le, lt = (_bound(field, name) for name in ("ge", "gt", "le", "lt"))
    if ge is not None and le is not None:
        return f"{kind}, {_number(ge)} to {_number(le)}"
    limits = [
        f"{sign} {_number(value)}"
        for sign, value in (("≥", ge), (">", gt), ("≤", le), ("<", lt))
        if value is not None
    ]
    return ", ".join([kind, *limits])


def _bound(field: FieldInfo, name: str) -> Any:
    """The value of one of the field's annotated_types bounds (ge, max_length, ...), or None."""
    for item in field.metadata:
        if isinstance(item, annotated_types.BaseMetadata) and hasattr(item, name):
            return getattr(item, name)
    return None


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in get_args(annotation) if arg is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(f"`{member.value}`" for member in annotation)
    if origin is list:
        (item,) = get_args(annotation)
        return f"list of {_type_name(item)}s"
    if origin is dict:
        return "object"
    return _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | dict):
        return f"`{json.dumps(_plain(value))}`"
    return f"`{_number(value) if isinstance(value, float) else value}`"


def _plain(value: Any) -> Any:
    """Whole floats as integers, as a person would write them."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return _number(value) if isinstance(value, float) else value


def _number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m core.config.reference",
        description="Print the settings reference (docs/settings.md), or write it.",
    )
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.name} in docs/")
    args = parser.parse_args(argv)
    if args.write:
        PAGE.write_text(render(), encoding="utf-8")
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
