# ruff: noqa: RUF001, RUF002
"""What every benchmark's tables are written with: the results files of a folder, a figure
over its runs, number formats and Markdown tables (bench/render.py puts the tables into
the documents; each benchmark renders its own beside its code)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

Doc = dict[str, Any]
T = TypeVar("T")

# What bench/results.py writes in front of every file's figures (older files named the
# commit at the top): no benchmark's type declares them.
HEAD = frozenset({"date", "command", "via_make", "smoke", "git", "machine", "settings", "commit"})


class Results:
    """The results files of a folder, read once each, by name (``api`` is api.json)."""

    def __init__(self, folder: Path, smoke: bool = False) -> None:
        self.folder = folder
        self.smoke = smoke  # a smoke run's files are read only to prove they still render
        self.read: dict[str, Doc] = {}

    def __getitem__(self, name: str) -> Doc:
        if name not in self.read:
            doc = json.loads((self.folder / f"{name}.json").read_text())
            if doc.get("smoke") and not self.smoke:
                raise ValueError(f"{name}.json is a smoke run's: its figures mean nothing")
            self.read[name] = doc
        return self.read[name]

    def typed(self, name: str, cls: type[T]) -> T:
        """``name``'s file as its benchmark's type (the head left out: see :data:`HEAD`)."""
        doc = self[name]
        try:
            return typed(cls, without_head(doc))
        except ValueError as exc:
            raise ValueError(f"{name}.json: {exc}") from None

    def has(self, name: str) -> bool:
        """Whether the folder holds ``name``'s file (a benchmark that needs an extra may not)."""
        return name in self.read or (self.folder / f"{name}.json").exists()


def without_head(doc: Mapping[str, Any]) -> Doc:
    """A results file's figures: what its benchmark's type describes (see :data:`HEAD`)."""
    return {k: v for k, v in doc.items() if k not in HEAD}


def typed(cls: Any, value: Any, where: str = "") -> Any:
    """``value`` (as json.loads gives it) as ``cls``: a dataclass, a list, tuple or dict of
    them, ``X | None``, a number, string or bool, or Any (taken as it is).

    Every field without a default must be there and no key may be there that the
    dataclass lacks: a file that does not say what its type says fails here, naming
    the place (``rounds[0].modes[1].drain: no field 'jobs'``), not as a wrong table.
    JSON's object keys are strings; a ``dict[int, ...]`` gets its keys back as numbers,
    and a ``float`` its NaN back where the file has null (``X | None`` keeps the None).
    """
    at = where or "the file"
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if cls is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{at}: only X | None is supported, not {cls}")
        return typed(options[0], value, where)
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        if not isinstance(value, dict):
            raise ValueError(f"{at}: an object was expected, not {type(value).__name__}")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(f"{at}: {cls.__name__} has no field {unknown[0]!r}")
        found = {}
        for name, spec in fields.items():
            if name in value:
                found[name] = typed(hints[name], value[name], f"{where}.{name}".lstrip("."))
            elif spec.default is spec.default_factory is dataclasses.MISSING:
                raise ValueError(f"{at}: no field {name!r}")
        return cls(**found)
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list):
            raise ValueError(f"{at}: a list was expected, not {type(value).__name__}")
        items = [typed(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ValueError(f"{at}: an object was expected, not {type(value).__name__}")
        key_type, value_type = args
        bad = [k for k in value if key_type is int and not k.lstrip("-").isdigit()]
        if bad:
            raise ValueError(f"{at}: the key {bad[0]!r} is not a number")
        return {
            (int(k) if key_type is int else k): typed(value_type, v, f"{where}[{k!r}]")
            for k, v in value.items()
        }
    if cls is float and type(value) in (int, float):  # a script may write a float as 2
        return value
    if cls is float and value is None:  # bench.results.finite wrote a NaN (measured nothing)
        # A new NaN each time, as each was measured: one shared object would make a set of
        # them one item (a renderer that shows one figure where the rounds agree).
        return float("nan")
    if cls in (int, str, bool) and type(value) is cls:
        return value
    raise ValueError(f"{at}: {cls.__name__} was expected, not {value!r}")


# --- figures ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """A figure a benchmark summarised over its rounds (bench.results.spread writes it)."""

    median: float  # NaN: no round measured it
    min: float
    max: float


@dataclass(frozen=True)
class Figure:
    """One figure over the runs that measured it."""

    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> Figure:
        return cls(tuple(values))

    @classmethod
    def summary(cls, spread: Mapping[str, float] | Spread) -> Figure:
        """From a results file's {median, min, max} (rounds it already summarised)."""
        if isinstance(spread, Spread):
            spread = dataclasses.asdict(spread)
        if spread["min"] == spread["max"]:
            return cls((spread["median"],))
        return cls((spread["min"], spread["median"], spread["max"]))

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def low(self) -> float:
        return min(self.runs)

    @property
    def high(self) -> float:
        return max(self.runs)

    def text(self, fmt: Fmt, bold: bool = False) -> str:
        """The median (bold if asked), then the runs' range where there were several."""
        shown = f"**{fmt(self.median)}**" if bold else fmt(self.median)
        if len(self.runs) < 2:
            return shown
        return f"{shown} ({fmt.bare(self.low)}–{fmt.bare(self.high)})"

    def meets(self, target: float, at_least: bool) -> bool:
        """Every run meets the target: a range that crosses it does not."""
        return self.low >= target if at_least else self.high <= target


@dataclass(frozen=True)
class Fmt:
    """How a figure is written: ``1,586``, ``41.6 %``, ``1.87×``; bare, without the unit."""

    digits: int = 0
    suffix: str = ""
    scale: float = 1.0

    def bare(self, value: float) -> str:
        return f"{self.scale * value:,.{self.digits}f}"

    def __call__(self, value: float) -> str:
        return self.bare(value) + self.suffix


def decimal(digits: int = 0, suffix: str = "") -> Fmt:
    return Fmt(digits, suffix)


def percent(digits: int = 0) -> Fmt:
    return Fmt(digits, " %", 100.0)


def times(digits: int = 2) -> Fmt:
    return Fmt(digits, "×")


def batches(count: int) -> str:
    return {0: "no batch", 1: "one batch"}.get(count, f"{count:,} batches")


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def day(doc: Doc) -> str:
    return str(doc["date"])[:10]


def measured_on(doc: Doc) -> str:
    """Where a results file's figures come from: its day, its machine and its commit."""
    return f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}"


def machine_text(doc: Doc) -> str:
    """The machine as a results file recorded it (older files recorded less)."""
    found = doc.get("machine")
    if isinstance(found, str):
        return found
    if not isinstance(found, dict):
        return "machine not recorded"
    cores = found.get("cores") or found.get("cpu_count")
    parts = [found.get("cpu") or found.get("machine") or found.get("arch"), f"{cores} cores"]
    if found.get("memory_gib"):
        parts.append(f"{found['memory_gib']} GiB")
    parts.append(found["gpu"] if found.get("gpu") else "no GPU")
    return ", ".join(str(p) for p in parts if p)


def commit_text(doc: Doc) -> str:
    git = doc.get("git")
    commit = git.get("commit") if isinstance(git, dict) else doc.get("commit")
    return f"commit {commit[:7]}" if commit else "commit not recorded"


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table; ``align`` has one letter a column, l or r."""
    marks = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def counted(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"
