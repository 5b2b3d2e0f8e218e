"""`python -m bench all`: every benchmark in one command (bench/__main__.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import BENCHES
from bench.__main__ import main as bench_main
from bench.results import RESULTS

ROOT = Path(__file__).resolve().parents[2]


def test_a_smoke_run_never_writes_the_published_results() -> None:
    with pytest.raises(SystemExit):
        bench_main(["all", "--smoke", "--out", str(RESULTS)])


def test_the_benchmarks_are_listed_with_their_commands() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "bench", "list"], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    for name in ("scheduler", "e2e", "api", "clients", "backfill", "fairness", "pipeline"):
        assert f"\n{name} " in f"\n{listed}"


def test_every_benchmark_writes_its_results_file_where_it_is_told() -> None:
    for bench in BENCHES:
        source = (ROOT / (bench.module.replace(".", "/") + ".py")).read_text()
        assert '"--out"' in source, f"{bench.module} takes no --out"
        assert "results.write(" in source or "results.provenance(" in source, bench.module
