"""Where `make test`'s time goes: ``python -m tests.suite_report [REPORT_DIR]``.

`make test` leaves two files in its report folder (``.ferry/test-report``):
``junit.xml``, pytest's JUnit XML report, and ``steps.tsv``, one line per step
(``name<TAB>wall seconds<TAB>exit status``, written by ``.ci/timed``): the
virtual environment, then the checks and pytest side by side. This prints the
slowest files (their tests' times summed), the files whose tests used the most
CPU (each test's ``cpu_s``, recorded by tests/conftest.py: on two cores the
suite is bound by its CPU, and a test's wall time grows with what runs beside
it), the slowest tests, the test counts, the time spent before pytest started
and each step's.

A test's time in the JUnit XML is its setup, call and teardown together, so a
session fixture's setup is counted in the first test that uses it.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(".ferry/test-report")
# What `make test` waits for before pytest starts; the checks run beside pytest, and the
# rest of steps.tsv (ruff, mypy, ...) inside the checks.
BEFORE_PYTEST = ("venv", "compile", "assert-cache")


@dataclass(frozen=True)
class Case:
    """One test case of the JUnit XML report."""

    file: str
    name: str
    time_s: float
    outcome: str  # passed, skipped, failed or error
    # What the test recorded with pytest's record_property (the bench smoke's seconds)
    # or put in its user_properties (the fault figures).
    properties: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Step:
    """One timed step of `make test` (a line of steps.tsv)."""

    name: str
    wall_s: float
    status: int


def _file_of(case: ET.Element) -> str:
    """The test's file: the ``file`` attribute where the report has it (xunit1), else
    its classname made a path, less the test classes (they start with a capital)."""
    file = case.get("file")
    if file:
        return file
    parts = case.get("classname", "").split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def _outcome(case: ET.Element) -> str:
    for tag, outcome in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            return outcome
    return "passed"


def parse_junit(text: str) -> list[Case]:
    """Every test case in a JUnit XML report (one ``<testsuite>`` or several)."""
    root = ET.fromstring(text)
    return [
        Case(
            file=_file_of(case),
            name=case.get("name", ""),
            time_s=float(case.get("time", "0") or 0),
            outcome=_outcome(case),
            properties=tuple(
                (prop.get("name", ""), prop.get("value", ""))
                for prop in case.iterfind("properties/property")
            ),
        )
        for case in root.iter("testcase")
    ]


def parse_steps(text: str) -> list[Step]:
    """The lines of steps.tsv; blank lines skipped."""
    steps = []
    for line in text.splitlines():
        if line.strip():
            name, wall_s, status = line.split("\t")
            steps.append(Step(name, float(wall_s), int(status)))
    return steps


def slowest_files(cases: list[Case], count: int = 20) -> list[tuple[str, float, int]]:
    """(file, summed seconds, number of tests), slowest first."""
    seconds: dict[str, float] = defaultdict(float)
    tests: Counter[str] = Counter()
    for case in cases:
        seconds[case.file] += case.time_s
        tests[case.file] += 1
    ranked = sorted(seconds.items(), key=lambda item: (-item[1], item[0]))
    return [(file, total_s, tests[file]) for file, total_s in ranked[:count]]


def cpu_of(case: Case) -> float:
    """The CPU seconds the test recorded (tests/conftest.py), or 0."""
    return next((float(v) for k, v in case.properties if k == "cpu_s"), 0.0)


def busiest_files(cases: list[Case], count: int = 20) -> list[tuple[str, float, int]]:
    """(file, summed CPU seconds, number of tests), the most CPU first."""
    seconds: dict[str, float] = defaultdict(float)
    tests: Counter[str] = Counter()
    for case in cases:
        seconds[case.file] += cpu_of(case)
        tests[case.file] += 1
    ranked = sorted(seconds.items(), key=lambda item: (-item[1], item[0]))
    return [(file, total_s, tests[file]) for file, total_s in ranked[:count]]


def slowest_tests(cases: list[Case], count: int = 20) -> list[Case]:
    return sorted(cases, key=lambda case: (-case.time_s, case.file, case.name))[:count]


@dataclass(frozen=True)
class WorkerSpan:
    """One pytest-xdist worker's tests: from its first test's start to its last's end."""

    worker: str
    started_s: float  # since the first test of the run started
    ended_s: float
    busy_s: float  # its tests' seconds, summed
    tests: int


def _property(case: Case, name: str) -> str | None:
    return next((v for k, v in case.properties if k == name), None)


def worker_spans(cases: list[Case]) -> list[WorkerSpan]:
    """Each worker's span (tests/conftest.py records the worker and when each test
    ended), the one that ended first first; empty where the report has neither."""
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for case in cases:
        worker, ended = _property(case, "worker"), _property(case, "ended_at")
        if worker is not None and ended is not None:
            runs[worker].append((float(ended) - case.time_s, float(ended)))
    if not runs:
        return []
    zero = min(start for spans in runs.values() for start, _ in spans)
    found = [
        WorkerSpan(
            worker,
            round(min(start for start, _ in spans) - zero, 1),
            round(max(end for _, end in spans) - zero, 1),
            round(sum(end - start for start, end in spans), 1),
            len(spans),
        )
        for worker, spans in runs.items()
    ]
    return sorted(found, key=lambda span: (span.ended_s, span.worker))


def outcomes(cases: list[Case]) -> Counter[str]:
    return Counter(case.outcome for case in cases)


def before_pytest_s(steps: list[Step]) -> float:
    """The wall time `make test` spent before pytest started."""
    return sum(step.wall_s for step in steps if step.name in BEFORE_PYTEST)


def render(cases: list[Case], steps: list[Step], count: int = 20) -> str:
    lines = []
    if steps:
        lines.append(f"before pytest: {before_pytest_s(steps):.1f} s")
        lines.extend(
            f"  {step.name:<12} {step.wall_s:8.1f} s"
            + ("" if step.status == 0 else f"  (exit {step.status})")
            for step in steps
        )
    counted = outcomes(cases)
    lines.append(
        f"tests: {len(cases)} ("
        + ", ".join(f"{counted[o]} {o}" for o in ("passed", "skipped", "failed", "error"))
        + f"), {sum(case.time_s for case in cases):.1f} s in all, "
        + f"{sum(cpu_of(case) for case in cases):.1f} CPU s"
    )
    spans = worker_spans(cases)
    if spans:
        lines.append("workers (started, ended and busy seconds from the first test's start):")
        lines.extend(
            f"  {span.worker:<6} {span.started_s:7.1f} {span.ended_s:7.1f} {span.busy_s:7.1f}"
            f"  {span.tests:5d} tests"
            for span in spans
        )
        lines.append(
            f"  the last worker ran on alone for {spans[-1].ended_s - spans[-2].ended_s:.1f} s"
            if len(spans) > 1
            else "  one worker"
        )
    lines.append(f"slowest {count} files (seconds, tests):")
    ranked = slowest_files(cases, count)
    lines.extend(f"  {total_s:8.1f} {tests:5d}  {file}" for file, total_s, tests in ranked)
    lines.append(f"most CPU, {count} files (CPU seconds, tests):")
    busiest = busiest_files(cases, count)
    lines.extend(f"  {total_s:8.1f} {tests:5d}  {file}" for file, total_s, tests in busiest)
    lines.append(f"slowest {count} tests (seconds):")
    for case in slowest_tests(cases, count):
        lines.append(f"  {case.time_s:8.1f}  {case.file}::{case.name}")
        # Only the seconds a test recorded (the fault figures' JSON is for the table).
        timings = [f"{k}={v}" for k, v in case.properties if k.endswith("_s")]
        if timings:
            lines.append("            " + ", ".join(timings))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Where make test's time went.")
    parser.add_argument("report_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--count", type=int, default=20)
    args = parser.parse_args(argv)
    junit = args.report_dir / "junit.xml"
    if not junit.exists():
        print(f"no {junit}: run make test first", file=sys.stderr)
        return 1
    steps_file = args.report_dir / "steps.tsv"
    steps = parse_steps(steps_file.read_text()) if steps_file.exists() else []
    print(render(parse_junit(junit.read_text()), steps, args.count))
    return 0


if __name__ == "__main__":
    sys.exit(main())
