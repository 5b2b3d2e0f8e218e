"""`ferry up` as a user runs it: its own Redis, SQLite, the API, both workers.

Submits minilm and sim jobs over HTTP and checks the results: embeddings equal
sentence-transformers' own, and a burst of sim jobs shares batches.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from harness import webclient
from harness.ports import free_port
from harness.processes import command_line, running
from tests.conftest import run_ferry
from tests.models import minilm_files

pytestmark = pytest.mark.e2e

TEXTS = [
    "A ferry leaves when it is full or when it is time.",
    "Urgent passengers board first.",
    "Redis Streams carry the jobs to the GPU workers, which run them in micro-batches.",
]


@dataclass
class Stack:
    base: str
    token: str
    cwd: Path
    env: dict[str, str]
    process: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def _reader(stream: Any, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)


@contextlib.contextmanager
def started_stack(cwd: Path, **settings: str) -> Iterator[Stack]:
    """``ferry up`` in ``cwd``, up with its workers; stopped (SIGTERM) afterwards if still
    running."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    port = free_port()
    env.update(
        FERRY_API_PORT=str(port),
        FERRY_METRICS_PORT_BASE=str(free_port()),
        # No Flower: nothing here looks at it (test_flower.py and test_cluster.py do).
        FERRY_FLOWER_PORT="0",
        FERRY_SIM_LATENCY_BASE_MS="40",
        FERRY_BATCH_WINDOW_MIN_MS="20",
        FERRY_BATCH_WINDOW_MAX_MS="20",
        FERRY_LOG_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
        **settings,
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "ferry", "up"],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output: list[str] = []
    threading.Thread(target=_reader, args=(process.stdout, output), daemon=True).start()
    stack = Stack(f"http://127.0.0.1:{port}", "", cwd, env, process, output)
    try:
        until = time.monotonic() + 180
        while not any("Ferry is up." in line for line in output):
            assert process.poll() is None, "".join(output)[-3000:]
            assert time.monotonic() < until, "".join(output)[-3000:]
            time.sleep(0.2)
        stack.token = next(line.split()[-1] for line in output if "API key" in line)
        _wait_for_workers(stack, until)
        yield stack
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with started_stack(tmp_path_factory.mktemp("stack")) as running:
        yield running


def _wait_for_workers(stack: Stack, until: float) -> None:
    # The models ferry up starts by default (resnet50 needs weights), or those asked for.
    served = stack.env.get("FERRY_MODELS", "minilm,sim").split(",")
    while True:
        models = webclient.get(
            f"{stack.base}/v1/models", headers=stack.headers(), timeout=10
        ).json()
        if all(m["workers"] >= 1 for m in models["data"] if m["name"] in served):
            return
        assert stack.process.poll() is None, "".join(stack.output)[-3000:]
        assert time.monotonic() < until, models
        time.sleep(0.5)


def _submit(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    response = webclient.post(
        f"{stack.base}/v1/jobs", json=body, headers=stack.headers(), timeout=30
    )
    assert response.status_code == 202, response.text
    return dict(response.json())


def _result(stack: Stack, job_id: str) -> dict[str, Any]:
    until = time.monotonic() + 60
    while True:
        response = webclient.get(
            f"{stack.base}/v1/jobs/{job_id}", params={"wait": 10}, headers=stack.headers(),
            timeout=30,
        )  # fmt: skip
        job = dict(response.json())
        if job["status"] not in ("queued", "running"):
            return job
        assert time.monotonic() < until, job


def test_minilm_embeddings_match_sentence_transformers(stack: Stack) -> None:
    from sentence_transformers import SentenceTransformer

    ids = [_submit(stack, {"model": "minilm", "input": text})["id"] for text in TEXTS]
    jobs = [_result(stack, job_id) for job_id in ids]
    assert [job["status"] for job in jobs] == ["succeeded"] * len(TEXTS), jobs
    reference = SentenceTransformer(str(minilm_files()), device="cpu").encode(TEXTS)
    for job, expected in zip(jobs, reference, strict=True):
        got = np.asarray(job["output"], dtype=np.float64)
        assert got.shape == (384,)
        assert abs(np.linalg.norm(got) - 1.0) < 1e-4
        cosine = float(got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected)))
        assert cosine >= 0.999, cosine


def test_a_burst_of_sim_jobs_shares_batches(stack: Stack) -> None:
    bodies: list[dict[str, Any]] = [
        {"model": "sim", "input": {"cost": 1 + i % 5}} for i in range(40)
    ]
    with ThreadPoolExecutor(max_workers=16) as pool:
        ids = [job["id"] for job in pool.map(lambda body: _submit(stack, body), bodies)]
        jobs = list(pool.map(lambda job_id: _result(stack, job_id), ids))
    assert {job["status"] for job in jobs} == {"succeeded"}
    sizes = {job["batch"]["id"]: job["batch"]["size"] for job in jobs}
    assert max(sizes.values()) > 1, sizes
    assert all(
        job["output"] == {"cost": body["input"]["cost"]}
        for job, body in zip(jobs, bodies, strict=True)
    )


def test_keys_create_prints_a_working_key_on_its_last_line(stack: Stack) -> None:
    output = run_ferry(["keys", "create", "--name", "e2e"], stack.cwd, stack.env)
    token = output.strip().splitlines()[-1]
    assert token.startswith("fy_") and " " not in token
    response = webclient.get(
        f"{stack.base}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    assert response.status_code == 200
    assert response.json()["data"] == []  # a new key sees none of the other key's jobs
    printed = next(line for line in output.splitlines() if "signing secret" in line).split()[-1]
    shown = webclient.get(
        f"{stack.base}/v1/webhook-secret", headers={"Authorization": f"Bearer {token}"}, timeout=10
    ).json()["secret"]
    assert printed == shown and shown.startswith("whsec_")


def _children(parent: int) -> dict[int, str]:
    """The child processes of ``parent``, by pid, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent:
            found[int(entry.name)] = cmdline
    return found


def test_a_worker_killed_mid_batch_is_restarted_and_loses_nothing(stack: Stack) -> None:
    workers = [pid for pid, cmd in _children(stack.process.pid).items() if "--model sim" in cmd]
    assert len(workers) == 1, _children(stack.process.pid)
    # Costly jobs, so batches take long enough to be caught running.
    ids = [_submit(stack, {"model": "sim", "input": {"cost": 600}})["id"] for _ in range(8)]
    # Until one runs (or, on a machine so loaded that every poll missed the batches
    # running, all have run: the kill then lands between batches, and what is asserted
    # below still holds); only a worker that never runs anything reaches the timeout.
    until = time.monotonic() + 120
    while True:
        page = webclient.get(
            f"{stack.base}/v1/jobs", params={"model": "sim", "limit": 100},
            headers=stack.headers(), timeout=10,
        ).json()  # fmt: skip
        statuses = {job["id"]: job["status"] for job in page["data"] if job["id"] in ids}
        if "running" in statuses.values() or (
            len(statuses) == len(ids) and "queued" not in statuses.values()
        ):
            break
        assert time.monotonic() < until, statuses
        time.sleep(0.01)
    os.kill(workers[0], signal.SIGKILL)

    jobs = {job_id: _result(stack, job_id) for job_id in ids}
    assert {job["status"] for job in jobs.values()} == {"succeeded"}, jobs
    assert all(job["output"] == {"cost": 600} for job in jobs.values())
    # A job the kill interrupted ran again once, at most (a job listed as running
    # may also have finished just before the kill). That the interrupted batch
    # does run again is asserted by tests/faults/test_kill.py, which catches the
    # batch from the worker's own log.
    attempts = [job["attempts"] for job in jobs.values()]
    assert set(attempts) <= {1, 2}, attempts
    assert any("worker-sim exited with code -9; restarting" in line for line in stack.output)
    assert stack.process.poll() is None


def test_sigterm_stops_the_whole_stack(tmp_path: Path) -> None:
    # A stack of its own (the module's serves the other tests, in whatever order they
    # run), with the sim model only: what stops is the same set of processes.
    with started_stack(tmp_path, FERRY_MODELS="sim") as stack:
        stack.process.send_signal(signal.SIGTERM)
        code = stack.process.wait(timeout=90)
        # The tail of the output, and every traceback frame any process logged on the way
        # (Celery's redirected stderr logs a traceback a line at a time, its frames first).
        frames = [line for line in stack.output if "Traceback" in line or 'File \\"' in line]
        said = "".join(stack.output)[-3000:] + "\n-- frames --\n" + "".join(frames[-40:])
        assert code == 0, said
        with pytest.raises(httpx.ConnectError):
            webclient.get(f"{stack.base}/healthz", timeout=2)
        assert any(line.strip() == "stopped" for line in stack.output)


def test_a_killed_ferry_up_takes_its_processes_with_it(tmp_path: Path) -> None:
    # Killed where it can stop nothing (SIGKILL, the OOM killer): the kernel sends each of
    # its processes, its Redis among them, the SIGTERM it would have, and none runs on
    # without a supervisor (a Celery worker whose Redis went with it spins on reconnects).
    with started_stack(tmp_path, FERRY_MODELS="sim") as stack:
        children = _children(stack.process.pid)
        kinds = {kind for kind in ("redis-server", "--model sim", "celery", " api") if any(
            kind in command for command in children.values()
        )}  # fmt: skip
        assert kinds == {"redis-server", "--model sim", "celery", " api"}, children
        stack.process.kill()
        stack.process.wait(timeout=10)
        until = time.monotonic() + 60
        try:
            while left := {pid: cmd for pid, cmd in children.items() if running(pid)}:
                assert time.monotonic() < until, left
                time.sleep(0.2)
        finally:  # what a failure leaves running must not load the rest of the suite
            for pid in filter(running, children):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_each_child_runs_its_own_command_forked_or_started_anew(tmp_path: Path, fork: str) -> None:
    """FERRY_UP_FORK: the children are forks of `ferry up` (each named by its command, one
    title string) or new interpreters (exec's arguments); either serves."""
    with started_stack(
        tmp_path, FERRY_MODELS="sim", FERRY_UP_CELERY="0", FERRY_UP_FORK=fork
    ) as stack:
        raw = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _children(stack.process.pid)]
        ours = [line for line in raw if b"ferry" in line]
        assert sorted(command_line(line)[2:4] for line in ours) == [
            ["ferry", "api"],
            ["ferry", "worker"],
        ], raw
        assert all((b"\0-m\0ferry\0" in line) == (fork == "0") for line in ours), raw
        job = _result(stack, _submit(stack, {"model": "sim", "input": {"cost": 1}})["id"])
        assert job["status"] == "succeeded", job
