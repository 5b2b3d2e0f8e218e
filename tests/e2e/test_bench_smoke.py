"""Every benchmark still runs, and its results still render: `make bench-smoke` in `make test`.

Each benchmark runs for seconds (``python -m bench all --smoke``) into a
temporary folder, never bench/results/; its figures mean nothing. What this
holds to: every script starts its stacks, measures, writes a results file
with the commit, the date, the machine and the settings, and bench/render.py
renders every table from those files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.__main__ import BENCHES, missing

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.mark.timeout(900)
def test_every_benchmark_runs_for_seconds_and_renders(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "all", "--smoke", "--parallel", "3", "--out",
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=840, check=False,
    )  # fmt: skip
    report = done.stdout + done.stderr
    # Each benchmark's seconds and CPU seconds, as properties of this test in the JUnit
    # XML report (make test-report): where the smoke run's time goes.
    line = r"^(\w+) +(?:ok|failed) +(\d+) s +(\d+) cpu-s"
    for name, seconds, cpu in re.findall(line, report, re.M):
        record_property(f"bench_{name}_s", int(seconds))
        record_property(f"bench_{name}_cpu_s", int(cpu))
    assert done.returncode == 0, report
    # The GPU benchmark and the peers (the bench extra's Ray, which make test never
    # installs) run only where what they need is there; so do the API benchmarks,
    # which need wrk, outside CI (.ci/run installs it); the others always.
    optional = {"cuda", "ray"} if IN_CI else {"cuda", "ray", "wrk"}
    ran = [b for b in BENCHES if not optional & set(b.needs) or missing(b) is None]
    for bench in ran:
        assert f"{bench.name:10} ok" in report, report
        result = json.loads((tmp_path / f"{bench.name}.json").read_text())
        assert result["smoke"] is True, bench.name
        assert len(result["git"]["commit"]) == 40, bench.name
        assert {"cpu", "cores", "memory_gib", "gpu"} <= set(result["machine"]), bench.name
        assert result["settings"], bench.name
    rendered = (tmp_path / "rendered.md").read_text()
    absent = {f"(no results file: {b.name}.json)" for b in BENCHES if b not in ran}
    # make mutation writes its own file (minutes of mutmut, never a smoke run).
    absent.add("(no results file: mutation.json)")
    # make faults writes its own (the fault suite, never a smoke run).
    absent.add("(no results file: faults.json)")
    # bench/gpu_check.sh's generation run writes its own, on a GPU (never a smoke run).
    absent.add("(no results file: generation_gpu.json)")
    # So does the generation benchmark's larger offline batch (minutes, never a smoke run).
    absent.add("(no results file: generation_offline.json)")
    for line in rendered.splitlines():
        assert not line.startswith("(no results file") or line in absent, rendered
