"""`python -m bench all`: every benchmark in one command (bench/__main__.py)."""

from __future__ import annotations

import json
import os
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


PROBE = """\
import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--exit", type=int, default=0)
parser.add_argument("--fail", action="store_true")
parser.add_argument("--out")
args = parser.parse_args()
print("smoke", os.environ["FERRY_BENCH_SMOKE"], "out", args.out)
# Imported by the runner before it forked (its PRELOAD, below), by nothing here.
print("preloaded", "xml.dom.minidom" in sys.modules, "main", __name__)
if args.fail:
    raise RuntimeError("the probe failed")
sys.exit(args.exit)
"""

RUNNER = """\
import json
import sys
from pathlib import Path

import bench.__main__ as runner

runner.PRELOAD = ("xml.dom.minidom",)
probes = [
    runner.Bench(name, "ferry_probe", (), args, 0)
    for name, args in (("good", ()), ("exits", ("--exit", "3")), ("fails", ("--fail",)))
]
outcomes = runner.run_all(probes, Path(sys.argv[1]), smoke=True, parallel=2)
print(json.dumps({o.bench.name: [o.status, o.why] for o in outcomes}))
"""


def test_a_smoke_run_forks_each_benchmark_from_the_preloaded_runner(tmp_path: Path) -> None:
    """Each benchmark runs as ``__main__`` in a fork of the runner (which imported PRELOAD
    once), with the smoke run's environment and its own log; its exit status, or the
    exception it raised, is its outcome."""
    (tmp_path / "ferry_probe.py").write_text(PROBE)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    outcomes = json.loads(done.stdout.splitlines()[-1])
    assert outcomes["good"] == ["ok", ""]
    assert outcomes["exits"][0] == "failed" and outcomes["exits"][1].startswith("exit 3:")
    assert outcomes["fails"][0] == "failed" and outcomes["fails"][1].startswith("exit 1:")
    assert "RuntimeError: the probe failed" in outcomes["fails"][1]
    log = (out / "good.log").read_text()
    assert f"smoke 1 out {out / 'good.json'}" in log
    assert "preloaded True main __main__" in log
