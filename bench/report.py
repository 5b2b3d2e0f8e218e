# ruff: noqa: RUF001, RUF002
"""What every benchmark's tables are written with: the results files of a folder, a figure
over its runs, number formats and Markdown tables (bench/render.py puts the tables into
the documents; each benchmark renders its own beside its code)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Doc = dict[str, Any]


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

    def has(self, name: str) -> bool:
        """Whether the folder holds ``name``'s file (a benchmark that needs an extra may not)."""
        return name in self.read or (self.folder / f"{name}.json").exists()


# --- figures ------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One figure over the runs that measured it."""

    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> Figure:
        return cls(tuple(values))

    @classmethod
    def summary(cls, spread: Mapping[str, float]) -> Figure:
        """From a results file's {median, min, max} (rounds it already summarised)."""
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


def runs_of(doc: Doc, key: str = "runs") -> list[Doc]:
    """A repeated benchmark's runs; a file of one run (written before repeats) is its own."""
    found = doc.get(key)
    return list(found) if isinstance(found, list) else [doc]


def day(doc: Doc) -> str:
    return str(doc["date"])[:10]


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
