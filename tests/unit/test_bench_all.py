"""`python -m bench all`: every benchmark in one command (bench/__main__.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import corpus
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


def test_the_benchmarks_of_a_run_read_the_corpus_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(corpus.CACHE_ENV, str(tmp_path))
    first = corpus.load_corpus(max_files=40)

    def again(*_args: object) -> None:
        raise AssertionError("read again")

    monkeypatch.setattr(corpus, "read_texts", again)
    monkeypatch.setattr(corpus, "token_costs", again)
    assert corpus.load_corpus(max_files=40) == first
    assert corpus.load_texts(max_files=40) == first.texts
