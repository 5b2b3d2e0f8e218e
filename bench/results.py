"""What every results file says about its run: the code, the date, the machine, the settings.

Each benchmark writes its results through :func:`write`, which puts in front
of the figures:

* ``date`` (UTC, ISO 8601) and ``command`` (``python -m bench.NAME ...``, never
  a path of the machine it ran on), ``via_make`` when ``make`` started it;
* ``git``: the commit, and the files that differed from it (``bench/results/``
  left out: a run rewrites it);
* ``machine``: CPU model, architecture, cores this process may use, memory,
  the GPU if any, Python, the load average at the start;
* ``smoke``: true for ``python -m bench all --smoke`` (seconds-long runs whose
  figures mean nothing; bench/render.py refuses to render from them);
* ``settings``: what the run was asked to do, as the script names it.

:func:`commit_of` and :func:`mixed_commits` read the commit back, for the
check that the documents cite one set of results from one commit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from bench.quantiles import median_range

# Set by `python -m bench all --smoke` for the benchmarks it starts (their stacks start
# no Flower then: harness.stack reads it too).
from harness.stack import SMOKE_ENV

T = TypeVar("T")

# The make target, where the Makefile names it.
MAKE_ENV = "FERRY_BENCH_MAKE"
RESULTS = Path(__file__).resolve().parent / "results"


def command_output(args: list[str]) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout + done.stderr).rstrip() if done.returncode == 0 else ""


def git_state() -> dict[str, Any]:
    changed = command_output(["git", "status", "--porcelain", "--", ".", ":!bench/results"])
    return {
        "commit": command_output(["git", "rev-parse", "HEAD"]),
        "uncommitted_changes": changed.splitlines(),
    }


def gpu() -> str | None:
    """The first GPU's name and memory, from nvidia-smi (importing torch here would cost
    seconds and the API benchmark's process never loads it)."""
    found = command_output(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    return found.splitlines()[0].strip() if found else None


def machine() -> dict[str, Any]:
    cpu, memory = platform.processor() or platform.machine(), 0.0
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) / 2**20
                break
    return {
        "cpu": cpu,
        "arch": platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory, 1),
        "gpu": gpu(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def provenance(bench: str, argv: list[str] | None) -> dict[str, Any]:
    """The run's own facts: when, the command, the code, the machine (call it at the start)."""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", f"bench.{bench}", *(argv or sys.argv[1:])]),
        "via_make": (
            os.environ.get(MAKE_ENV, f"make bench-{bench}") if os.environ.get("MAKELEVEL") else None
        ),
        "smoke": os.environ.get(SMOKE_ENV) == "1",
        "git": git_state(),
        "machine": machine(),
    }


def add_set_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--set FERRY_NAME=VALUE`` (repeatable): another setting for ``what``, parsed to a
    (name, value) pair (``dict(args.set)``); anything else is a usage error."""
    parser.add_argument(
        "--set",
        action="append",
        type=_setting,
        default=[],
        metavar="FERRY_NAME=VALUE",
        help=f"another setting for {what} (repeatable); recorded in the report",
    )


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("FERRY_"):
        raise argparse.ArgumentTypeError(f"--set takes FERRY_NAME=VALUE, not {text!r}")
    return name, value


def write(
    path: Path,
    figures: Mapping[str, Any],
    *,
    settings: Mapping[str, Any],
    head: Mapping[str, Any],
) -> None:
    """``head`` (from :func:`provenance`), the settings, then the figures, as JSON."""
    report = {**head, "settings": dict(settings), **figures}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(report), indent=2, allow_nan=False) + "\n")


def finite(value: Any) -> Any:
    """NaN and infinity (a figure over no jobs) as null, which JSON has."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def repeated(count: int, once: Callable[[], T], show: Callable[[T], None]) -> list[T]:
    """``once()`` run ``count`` times, each shown as it ends (a long benchmark says how it goes)."""
    runs = []
    for number in range(1, count + 1):
        print(f"run {number} of {count}", flush=True)
        runs.append(once())
        show(runs[-1])
    return runs


def spread(values: list[float]) -> dict[str, float]:
    """The median of repeated runs and their range (NaN, a run that measured nothing, left out)."""
    return median_range([v for v in values if v == v])


def commit_of(doc: Mapping[str, Any]) -> str | None:
    """The commit a results file was measured at (older files name it in two ways, or not)."""
    git = doc.get("git")
    commit = git.get("commit") if isinstance(git, dict) else doc.get("commit")
    return commit or None


def mixed_commits(docs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What keeps results files from being one set: a file of no known commit, a file of
    another commit than the most common one, or a file measured on uncommitted changes."""
    commits = {name: commit_of(doc) for name, doc in docs.items()}
    known = Counter(c for c in commits.values() if c)
    if not known:
        return [f"{name}: no commit recorded" for name in sorted(docs)]
    common = known.most_common(1)[0][0]
    problems = []
    for name, commit in sorted(commits.items()):
        if commit is None:
            problems.append(f"{name}: no commit recorded (the set is at {common[:7]})")
        elif commit != common:
            problems.append(f"{name}: measured at {commit[:7]}, the set at {common[:7]}")
        git = docs[name].get("git")
        if isinstance(git, dict) and git.get("uncommitted_changes"):
            problems.append(f"{name}: measured with uncommitted changes")
    return problems
