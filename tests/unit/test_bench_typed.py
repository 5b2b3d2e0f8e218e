"""A results file read as its benchmark's type (bench.report.typed): what a renderer reads
is what the benchmark's dataclass says, and a file that says otherwise fails by name."""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench import e2e
from bench.__main__ import BENCHES
from bench.report import Results, Spread, typed
from bench.results import RESULTS


@dataclass
class Phase:
    jobs: int
    p99_ms: float | None


@dataclass
class Round:
    number: int
    by_size: dict[int, float] = field(default_factory=dict)
    phases: list[Phase] = field(default_factory=list)
    extra: Any = None


def test_a_file_becomes_its_dataclasses_with_number_keys_and_defaults() -> None:
    found = typed(
        list[Round],
        [
            {"number": 1, "by_size": {"1": 66.9, "8": 86}, "phases": [{"jobs": 8, "p99_ms": None}]},
            {"number": 2, "extra": {"any": ["thing"]}},
        ],
    )
    assert found == [
        Round(1, {1: 66.9, 8: 86}, [Phase(8, None)]),
        Round(2, {}, [], {"any": ["thing"]}),
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"number": 1, "phases": [{"jobs": 8}]}, "phases[0]: no field 'p99_ms'"),
        ({"number": 1, "phases": [{"jobs": 8, "p99_ms": 1, "p50": 2}]}, "has no field 'p50'"),
        ({"number": "1"}, "number: int was expected, not '1'"),
        ({"number": True}, "number: int was expected, not True"),
        ({"number": 1, "phases": {}}, "phases: a list was expected, not dict"),
        ({"number": 1, "by_size": {"1": "fast"}}, "by_size['1']: float was expected"),
        ([], "an object was expected, not list"),
        ({"number": 1, "by_size": {"eight": 8.0}}, "by_size: the key 'eight' is not a number"),
    ],
)
def test_a_file_that_is_not_its_type_fails_naming_the_place(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        typed(Round, value)


# The results files no `python -m bench all` writes: `make mutation`'s, `make faults`'s,
# the GPU run's generation file (bench/gpu_check.sh) and the generation benchmark's larger
# offline batch (bench/README.md), each its benchmark's type.
OWN_RUNS = {
    "mutation": "bench.mutation",
    "faults": "bench.faults",
    "generation_gpu": "bench.generation",
    "generation_offline": "bench.generation",
}


def test_each_typed_results_file_reads_as_its_benchmarks_type() -> None:
    results = Results(RESULTS)
    checked, untyped = [], set()
    modules = {bench.name: bench.module for bench in BENCHES} | OWN_RUNS
    for name, module in modules.items():
        cls = getattr(importlib.import_module(module), "RESULT", None)
        if cls is None:
            untyped.add(name)
        elif results.has(name):
            results.typed(name, cls)
            checked.append(name)
    assert {"e2e", "scheduler", "mutation", "generation_gpu"} <= set(checked), checked
    assert not untyped, f"{sorted(untyped)}: a benchmark's module names its file's type"


def test_a_renderer_names_the_file_that_is_not_its_type(tmp_path: Path) -> None:
    doc = json.loads((RESULTS / "e2e.json").read_text())
    del doc["rounds"][0]["modes"][0]["drain"]["jobs"]
    (tmp_path / "e2e.json").write_text(json.dumps(doc))
    where = r"e2e.json: rounds\[0\].modes\[0\].drain: no field 'jobs'"
    with pytest.raises(ValueError, match=where):
        e2e.render_e2e(Results(tmp_path))


def test_null_in_a_float_field_is_the_nan_the_benchmark_measured() -> None:
    # bench.results.finite writes a NaN (a figure over no jobs) as null; an X | None keeps None.
    spread = typed(Spread, {"median": None, "min": 1, "max": None})
    assert math.isnan(spread.median) and spread.min == 1 and math.isnan(spread.max)
    assert typed(Phase, {"jobs": 0, "p99_ms": None}) == Phase(0, None)
    # Each its own NaN, as measured: a set of two is two (a renderer shows every round then).
    assert len({typed(float, None), typed(float, None)}) == 2
