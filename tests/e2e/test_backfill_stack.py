"""A 100,000-line backfill through `ferry up` and `ferry backfill submit --wait`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import webclient
from harness.processes import command_line
from harness.stack import FerryUp

pytestmark = pytest.mark.e2e

LINES = 100_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FerryUp]:
    stack = FerryUp(
        tmp_path_factory.mktemp("backfill-stack"),
        FERRY_MODELS="sim",
        FERRY_FLOWER_PORT="0",  # no Flower: nothing here looks at it (test_flower.py does)
        FERRY_SIM_LATENCY_BASE_MS="2",
        FERRY_SIM_LATENCY_PER_COST_MS="0.01",
        FERRY_BATCH_MAX_SIZE="256",
    )
    with stack.running(timeout_s=180):
        yield stack


def bulk_finished(stack: FerryUp) -> float:
    """The sim worker's count of bulk jobs succeeded, from its own /metrics (the first
    port `ferry up` hands out)."""
    base = int(stack.env["FERRY_METRICS_PORT_BASE"])
    worker = webclient.get(f"http://127.0.0.1:{base}/metrics", timeout=10).text
    finished = {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(worker)
        for sample in family.samples
        if sample.name == "ferry_jobs_finished_total"
    }
    return finished.get((("lane", "bulk"), ("model", "sim"), ("status", "succeeded")), 0.0)


def test_a_100k_line_file_comes_back_one_result_per_line_in_order(
    stack: FerryUp, tmp_path: Path
) -> None:
    source = tmp_path / "inputs.ndjson"
    with source.open("w") as out:
        for i in range(LINES):
            out.write(json.dumps({"custom_id": f"doc-{i}", "input": {"cost": 1 + i % 7}}) + "\n")
    results = tmp_path / "results.ndjson"
    env = dict(stack.env, FERRY_API_URL=stack.base, FERRY_API_KEY=stack.token)
    before = bulk_finished(stack)  # the module's other tests share the stack's worker
    run = subprocess.run(
        [sys.executable, "-m", "ferry", "backfill", "submit", str(source), "--model", "sim",
         "--wait", "--output", str(results)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"wrote {LINES} results" in run.stderr
    assert "completed [##############################] 100.0%" in run.stderr
    assert f"{LINES}/{LINES}" in run.stderr

    got = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(got) == LINES
    assert [r["custom_id"] for r in got] == [f"doc-{i}" for i in range(LINES)]
    assert all(r["status"] == "succeeded" for r in got)
    assert [r["output"]["cost"] for r in got] == [1 + i % 7 for i in range(LINES)]

    backfill_id = next(
        line.split()[1].rstrip(":") for line in run.stderr.splitlines() if "lines" in line
    )
    status = subprocess.run(
        [sys.executable, "-m", "ferry", "backfill", "status", backfill_id],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert "completed" in status.stdout
    assert f"completed {LINES}" in status.stdout

    # The sim worker counted every line.
    assert bulk_finished(stack) - before == LINES
    base = int(stack.env["FERRY_METRICS_PORT_BASE"])
    celery = webclient.get(f"http://127.0.0.1:{base + 1}/metrics", timeout=10)
    assert celery.status_code == 200 and "python_info" in celery.text
    assert f"worker-sim :{base}" in "".join(stack.output)


def test_a_bad_file_is_refused_by_the_cli_with_its_line(stack: FerryUp, tmp_path: Path) -> None:
    source = tmp_path / "bad.ndjson"
    source.write_text('{"custom_id": "a", "input": {"cost": 1}}\n{"custom_id": "a"}\n')
    env = dict(os.environ, FERRY_API_URL=stack.base, FERRY_API_KEY=stack.token)
    run = subprocess.run(
        [sys.executable, "-m", "ferry", "backfill", "submit", str(source), "--model", "sim"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1
    assert "error: 422: line 2: input: missing" in run.stderr


def ctrl_c_as_at_a_terminal() -> None:
    """SIGINT's default action in the command, as a shell at a terminal gives it: a suite
    started in the background by a shell without job control inherits SIGINT ignored,
    and Python then never turns it into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_waiting_leaves_the_backfill_running(stack: FerryUp, tmp_path: Path) -> None:
    source = tmp_path / "inputs.ndjson"
    source.write_text(
        "".join(
            json.dumps({"custom_id": str(i), "input": {"cost": 3}}) + "\n" for i in range(20_000)
        )
    )
    env = dict(stack.env, FERRY_API_URL=stack.base, FERRY_API_KEY=stack.token)
    # The sim worker is paused while the command waits: Ctrl-C must land on a backfill
    # still running (this stack's worker runs 20,000 lines in about 4 s, which a busy
    # machine may take to deliver the signal).
    worker = next(
        pid
        for pid in stack.children()
        if command_line(Path(f"/proc/{pid}/cmdline").read_bytes())[2:4] == ["ferry", "worker"]
    )
    os.kill(worker, signal.SIGSTOP)
    try:
        follow = subprocess.Popen(
            [sys.executable, "-m", "ferry", "backfill", "submit", str(source), "--model", "sim",
             "--wait"],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=ctrl_c_as_at_a_terminal,
        )  # fmt: skip
        assert follow.stderr is not None
        seen: list[str] = []
        for line in follow.stderr:  # not a terminal: one progress line every few seconds
            seen.append(line)
            if line.startswith("in_progress ["):
                break
        follow.send_signal(signal.SIGINT)
        _out, rest = follow.communicate(timeout=60)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert follow.returncode == 130, "".join(seen) + rest
    backfill_id = next(line.split()[1].rstrip(":") for line in seen if " lines" in line)
    assert f"backfill {backfill_id} keeps running" in rest
    assert f"ferry backfill status {backfill_id} --wait" in rest

    results = tmp_path / "results.ndjson"
    again = subprocess.run(
        [sys.executable, "-m", "ferry", "backfill", "status", backfill_id, "--wait",
         "--output", str(results)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(results.read_text().splitlines()) == 20_000
