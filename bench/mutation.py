"""Mutation testing of the scheduler and of the recorder's terminal write (mutmut).

    python -m bench.mutation                      # both targets: about 10 minutes on 2 cores
    python -m bench.mutation --target scheduler   # scheduler/ alone: about 6 minutes

Each target runs in a scratch copy of the working tree of its own,
``mutants/<target>/`` (git ignores it), with the project's pyproject.toml and
a ``[tool.mutmut]`` table for that target, so the two runs never share
mutmut's cache and an edit made in the tree meanwhile changes neither. The
copy is made afresh every time: the figures are those of the code and the
tests as they are now, never a cache of an earlier run's.

* ``scheduler``: every function of ``scheduler/`` (pure Python), against its
  fast unit tests.
* ``recorder``: ``Recorder.finish`` (the conditional write of a job's
  terminal status: the first terminal write wins, a stale worker's late
  result is refused) and ``_batched_writes`` in ``workers/gpu/recorder.py``,
  against the integration tests that write outcomes and what the same
  transaction does for them (a key's outstanding count, a backfill's counts,
  a webhook's delivery); they need Redis and SQLite, and PostgreSQL where one
  is reachable (skipped otherwise).

Writes ``bench/results/mutation.json``: the run's commit, date and machine
(:mod:`bench.results`), then per target and per file the mutants, killed,
survived, timeout and score (killed or timed out over all mutants), and every
surviving mutant with its diff. To look at survivors afterwards:
``cd mutants/scheduler && ../../.venv/bin/mutmut browse`` (or ``mutmut show NAME``).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import results
from bench.report import Results, measured_on
from bench.report import table as markdown_table

ROOT = results.RESULTS.parent.parent
WORK = ROOT / "mutants"
# Run mutmut from the interpreter's own environment (mutmut warns against python -m mutmut).
MUTMUT = Path(sys.executable).parent / "mutmut"


@dataclass(frozen=True)
class Target:
    name: str
    mutate: tuple[str, ...]  # mutmut's source_paths: copied into mutants/ and mutated
    tests: tuple[str, ...]  # pytest's arguments that select the tests
    only_mutate: tuple[str, ...] = ()  # files of mutate to mutate (all, if empty)
    functions: tuple[str, ...] = ()  # mutant name patterns to run and count (all, if empty)
    minutes: float = 0.0  # about, on 2 cores
    notes: str = ""


SCHEDULER = Target(
    name="scheduler",
    mutate=("scheduler/",),
    tests=(
        "tests/unit/test_batcher.py",
        "tests/unit/test_scheduler_*.py",
        "tests/unit/test_scheduling_settings.py",
        "tests/unit/test_simulator.py",
    ),
    minutes=6,
    notes="every function of scheduler/, against its unit tests",
)
RECORDER = Target(
    name="recorder",
    mutate=("workers/",),
    only_mutate=("workers/gpu/recorder.py",),
    functions=(
        "workers.gpu.recorder.xǁRecorderǁfinish__mutmut_*",
        "workers.gpu.recorder.x__batched_writes__mutmut_*",
    ),
    tests=(
        "tests/integration/test_worker.py::test_terminal_writes_are_conditional",
        "tests/integration/test_worker.py::"
        "test_a_batch_is_written_in_one_statement_as_one_per_job_would_write_it",
        "tests/integration/test_worker.py::test_a_job_that_keeps_killing_its_worker_is_dead_lettered",
        "tests/integration/test_recovery.py::test_a_result_the_database_refuses_fails_that_job_alone",
        # What the same transaction does for the jobs written (core/db/terminal.py).
        "tests/integration/test_usage.py::test_the_counter_follows_submissions_results_and_cancellations",
        "tests/integration/test_backfills.py::test_failed_items_are_counted_and_reported",
        "tests/integration/test_webhooks.py::test_the_delivery_row_is_committed_with_the_outcome",
    ),
    minutes=4,
    notes="Recorder.finish and _batched_writes, against the integration tests that write outcomes",
)
TARGETS = {t.name: t for t in (SCHEDULER, RECORDER)}


@dataclass
class Outcome:
    target: Target
    seconds: float
    statuses: dict[str, dict[str, str]] = field(default_factory=dict)  # path -> mutant -> status
    diffs: dict[str, list[str]] = field(default_factory=dict)  # surviving mutant -> its diff
    failed: str = ""


@dataclass
class Counts:
    """A file's mutants, or a target's, by what became of them (summary writes it)."""

    mutants: int
    killed: int
    survived: int
    timeout: int
    other: dict[str, int]  # no tests, suspicious, segfault...
    score: float | None  # None: no mutant


@dataclass
class TargetResult:
    """One target's run (report writes it)."""

    what: str
    mutated: list[str]
    functions: Any  # "all", or the mutants' function patterns
    tests: list[str]
    uncommitted_changes: list[str]
    seconds: float
    failed: str | None = None
    files: dict[str, Counts] = field(default_factory=dict)
    total: Counts | None = None
    survivors: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # their diffs


@dataclass
class Report:
    """bench/results/mutation.json besides its head (bench.report.typed reads it)."""

    targets: dict[str, TargetResult]


RESULT = Report


def tree_files() -> list[str]:
    """The working tree as git sees it: tracked files and untracked ones it does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [p for p in listed.split("\0") if p and not p.startswith("bench/results/")]


def selected_tests(work: Path, target: Target) -> list[str]:
    """The target's test arguments, file patterns expanded (pytest gets no shell)."""
    chosen: list[str] = []
    for test in target.tests:
        found = [p.relative_to(work).as_posix() for p in work.glob(test)] if "*" in test else []
        chosen += sorted(found) or [test]
    return chosen


def mutmut_table(target: Target, tests: list[str], top_dirs: list[str]) -> str:
    """The [tool.mutmut] table of ``target``, in a copy whose top-level folders are ``top_dirs``."""
    mutated = {path.split("/")[0] for path in target.mutate}
    config = {
        "source_paths": list(target.mutate),
        "only_mutate": list(target.only_mutate),
        "pytest_add_cli_args_test_selection": tests,
        "pytest_add_cli_args": ["-p", "no:cacheprovider"],
        # What the tests import besides the mutated code (tests/ is copied anyway).
        "also_copy": [f"{d}/" for d in top_dirs if d not in mutated | {"tests", "mutants"}],
    }
    return "\n[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items())


def prepare(target: Target) -> Path:
    """A fresh copy of the working tree under mutants/<target>/, configured for ``target``."""
    work = WORK / target.name
    shutil.rmtree(work, ignore_errors=True)
    files = tree_files()
    for path in files:
        source = ROOT / path
        if source.is_file():  # a file deleted but not yet staged is still listed
            (work / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, work / path)
    project = (ROOT / "pyproject.toml").read_text()
    if "mutmut" in tomllib.loads(project).get("tool", {}):
        raise SystemExit("pyproject.toml has a [tool.mutmut] table; bench/mutation.py writes one")
    top_dirs = sorted({p.split("/")[0] for p in files if "/" in p})
    table = mutmut_table(target, selected_tests(work, target), top_dirs)
    (work / "pyproject.toml").write_text(project + table)
    tomllib.loads((work / "pyproject.toml").read_text())  # still valid TOML
    return work


def run(target: Target, max_children: int) -> Outcome:
    work = prepare(target)
    log = work / "mutmut.log"
    print(
        f"{target.name}: mutmut over {', '.join(target.only_mutate or target.mutate)} "
        f"(about {target.minutes:g} minutes on 2 cores); log: {log.relative_to(ROOT)}",
        flush=True,
    )
    # The simulator's corpus is costed with a Rust tokenizer before mutmut forks.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run(
            [str(MUTMUT), "run", "--max-children", str(max_children), *target.functions],
            cwd=work,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            check=False,
        )
    outcome = Outcome(target, round(time.monotonic() - started, 1))
    if done.returncode != 0:
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-20:]
        outcome.failed = f"mutmut exited {done.returncode}: " + "\n".join(tail)
        return outcome
    collect(work, outcome)
    return outcome


def collect(work: Path, outcome: Outcome) -> None:
    """Each mutant's status from mutmut's own files, and each survivor's diff."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    patterns = outcome.target.functions
    with contextlib.chdir(work):
        reset_config()  # mutmut reads its configuration from the working folder
        for meta in sorted(Path("mutants").rglob("*.py.meta")):
            path = meta.relative_to("mutants").as_posix().removesuffix(".meta")
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            statuses = {
                name: status_by_exit_code[code]
                for name, code in codes.items()
                if not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)
            }
            if not statuses:
                continue
            outcome.statuses[path] = statuses
            for name, status in statuses.items():
                if status == "survived":
                    diff = get_diff_for_mutant(name, path=path).splitlines()[2:]
                    outcome.diffs[name] = [line for line in diff if line[:1] in "+-"]
        reset_config()


def summary(statuses: list[str]) -> dict[str, Any]:
    count = Counter(statuses)
    mutants = len(statuses)
    killed, timeout = count.pop("killed", 0), count.pop("timeout", 0)
    return {
        "mutants": mutants,
        "killed": killed,
        "survived": count.pop("survived", 0),
        "timeout": timeout,
        "other": dict(sorted(count.items())),  # no tests, suspicious, segfault...
        # A mutant that makes the tests run away is caught too (mutmut's own score).
        "score": round((killed + timeout) / mutants, 4) if mutants else None,
    }


def uncommitted(target: Target) -> list[str]:
    """The mutated code and its tests as they differ from the commit (empty: the commit's)."""
    paths = [*(target.only_mutate or target.mutate), *(t.split("::")[0] for t in target.tests)]
    return results.command_output(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", *paths]
    ).splitlines()


def report(outcome: Outcome) -> dict[str, Any]:
    target = outcome.target
    doc: dict[str, Any] = {
        "what": target.notes,
        "mutated": list(target.only_mutate or target.mutate),
        "functions": list(target.functions) or "all",
        "tests": list(target.tests),
        "uncommitted_changes": uncommitted(target),
        "seconds": outcome.seconds,
    }
    if outcome.failed:
        return doc | {"failed": outcome.failed}
    doc["files"] = {path: summary(list(s.values())) for path, s in outcome.statuses.items()}
    doc["total"] = summary([status for s in outcome.statuses.values() for status in s.values()])
    doc["survivors"] = {
        path: {name: outcome.diffs[name] for name in s if name in outcome.diffs}
        for path, s in outcome.statuses.items()
        if any(name in outcome.diffs for name in s)
    }
    return doc


def table(name: str, doc: dict[str, Any]) -> list[str]:
    """The target's figures as a Markdown table (what bench/README.md quotes)."""
    if "failed" in doc:
        return [f"{name}: failed ({doc['failed'].splitlines()[0]})"]
    lines = [
        "| file | mutants | killed | timeout | survived | score |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    rows = [*doc["files"].items(), ("total", doc["total"])]
    for path, s in rows:
        score = "n/a" if s["score"] is None else f"{100 * s['score']:.1f} %"
        label = f"`{path}`" if path != "total" else "**total**"
        lines.append(
            f"| {label} | {s['mutants']} | {s['killed']} | {s['timeout']} | {s['survived']} "
            f"| {score} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mutation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--target", choices=[*TARGETS, "all"], default="all", help="what to mutate (default all)"
    )
    parser.add_argument(
        "--max-children",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="mutants tested at once (default: the cores this process may use)",
    )
    parser.add_argument("--out", type=Path, default=results.RESULTS / "mutation.json")
    args = parser.parse_args(argv)
    if not MUTMUT.exists():
        parser.error(f"mutmut is not installed next to {sys.executable} (pip install '.[dev]')")
    head = results.provenance("mutation", argv)
    chosen = list(TARGETS.values()) if args.target == "all" else [TARGETS[args.target]]
    targets = {t.name: report(run(t, args.max_children)) for t in chosen}
    import mutmut

    settings = {"mutmut": mutmut.__version__, "max_children": args.max_children}
    results.write(args.out, {"targets": targets}, settings=settings, head=head)
    for name, doc in targets.items():
        print(f"\n{name} ({doc['seconds']:.0f} s)")
        print("\n".join(table(name, doc)))
    print(f"\nwrote {args.out}")
    return 1 if any("failed" in doc for doc in targets.values()) else 0


# --- its tables (python -m bench.render) --------------------------------------------------


def render_mutation(results: Results) -> list[str]:
    doc, targets = results["mutation"], results.typed("mutation", Report).targets
    seconds = "; ".join(f"{name} {target.seconds:.0f} s" for name, target in targets.items())
    rows: list[tuple[str, Counts]] = []
    for name, target in targets.items():
        files = target.files
        for path, found in files.items():
            label = f"`{path}`"
            if name == "recorder":
                label += " (`finish`, `_batched_writes`)"
            rows.append((label, found))
        if len(files) > 1 and target.total is not None:
            rows.append((f"**{target.mutated[0]}**", target.total))
    return [
        f"{measured_on(doc)} ({seconds}):",
        "",
        *markdown_table(
            ["file", "mutants", "killed", "timeout", "survived", "score"],
            "lrrrrr",
            [
                [
                    label,
                    f"{found.mutants:,}",
                    f"{found.killed:,}",
                    f"{found.timeout:,}",
                    f"{found.survived:,}",
                    f"{100 * found.score:.1f} %" if found.score is not None else "n/a",
                ]
                for label, found in rows
            ],
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
