"""Hot reload under load: versions switch, roll back, and a broken one never takes traffic.

The API and two workers run on a repository built here, with the real Redis
and database, while a thread keeps submitting jobs. Versions are activated
through the admin endpoint; the workers load the new one beside the old,
switch, and drop the old. Every job must succeed exactly once and name the
version that ran it, and that version must be the one that computed it.
"""

from __future__ import annotations

import shutil
import textwrap
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.db.schema import Job, ModelActivation
from core.db.versions import version_states
from harness.threads import OnAThread
from tests.integration.conftest import RunningLoop, activate, wait_terminal
from tests.models import minilm_files
from tests.vectors import cosine
from workers.gpu.main import build_loop

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")

ECHO = """
name = "echo"
backend = "python"
active_version = 1

[input]
kind = "json"
[input.schema]
type = "integer"

[cost]
function = "constant"

[batching]
batch_max_size = 32
batch_window_max_ms = 5.0

[parameters]
class = "echo:Echo"
"""

ECHO_PY = """
import time
from pathlib import Path
from typing import Any


class Echo:
    def __init__(self, files: Path, parameters: dict[str, Any], device: str) -> None:
        self.version = int((files / "VERSION").read_text())
        time.sleep(0.3)  # a load that takes a while: batches go on meanwhile

    def predict(self, inputs: list[int]) -> list[dict[str, int]]:
        time.sleep(0.002)
        return [{"v": self.version, "x": x} for x in inputs]
"""

BROKEN_PY = """
class Echo:
    def __init__(self, files, parameters, device):
        raise ValueError("weights are corrupt: checksum mismatch")
"""


def echo_repository(root: Path) -> None:
    for version in (1, 2):
        add_version(root, version, ECHO_PY)
    (root / "echo" / "model.toml").write_text(ECHO)


def add_version(root: Path, version: int, source: str) -> None:
    """Version ``version`` of the echo model in the repository at ``root``, from ``source``."""
    folder = root / "echo" / str(version)
    folder.mkdir(parents=True)
    (folder / "echo.py").write_text(textwrap.dedent(source))
    (folder / "VERSION").write_text(str(version))


@pytest.fixture
def reload_settings(settings: Settings, tmp_path: Path) -> Settings:
    """Settings serving the echo repository, built under ``tmp_path / "models"``."""
    echo_repository(tmp_path / "models")
    return settings.model_copy(
        update={
            "model_repository": tmp_path / "models",
            "models": "echo",
            "model_parameters": {},
            "model_poll_s": 0.2,
            "device": "cpu",
            "rate_limit": "",
            "max_outstanding_jobs": 100_000,
        }
    )


class Load(OnAThread):
    """Submits jobs from a thread until stopped, remembering when each was accepted."""

    def __init__(
        self, client: TestClient, auth: dict[str, str], model: str, make: Callable[[int], Any]
    ):
        self.client, self.auth, self.model, self.make = client, auth, model, make
        self.accepted: list[tuple[float, str]] = []
        self.refused: list[str] = []
        super().__init__(self._run)

    def _run(self, stop: threading.Event) -> None:
        n = 0
        while not stop.is_set():
            response = self.client.post(
                "/v1/jobs", json={"model": self.model, "input": self.make(n)}, headers=self.auth
            )
            if response.status_code == 202:
                self.accepted.append((time.monotonic(), response.json()["id"]))
            else:
                self.refused.append(response.text)
            n += 1

    def ids(self, after: float = 0.0, before: float = float("inf")) -> list[str]:
        return [job for at, job in list(self.accepted) if after <= at < before]


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> float:
    until = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < until, "timed out"
        time.sleep(0.05)
    return time.monotonic()


def versions(client: TestClient, auth: dict[str, str], model: str) -> dict[int, dict[str, Any]]:
    data = client.get("/v1/models", headers=auth).json()["data"]
    return {v["version"]: v for v in next(m for m in data if m["name"] == model)["versions"]}


def start_echo(running: ExitStack, settings: Settings, workers: int) -> TestClient:
    """The API and ``workers`` echo workers, on ``running``, once every worker serves 1."""
    client = running.enter_context(TestClient(create_app(settings)))
    for n in range(1, workers + 1):
        running.enter_context(RunningLoop(build_loop(settings, "echo", name=f"echo-{n}")))
    wait_until(all_ready_on(settings, "echo", 1, workers))
    return client


def start_load(
    running: ExitStack,
    client: TestClient,
    auth: dict[str, str],
    model: str = "echo",
    make: Callable[[int], Any] = lambda n: n,
) -> Load:
    """A :class:`Load` on ``running``: stopped first, should anything fail."""
    load = Load(client, auth, model, make).__enter__()
    running.callback(load.__exit__)
    return load


def failed_on(
    client: TestClient, auth: dict[str, str], model: str, version: int, workers: int
) -> Callable[[], bool]:
    """Whether the API shows ``version`` failed on ``workers`` workers (a worker still loading
    it shows as loading: each follows an activation at its own poll)."""

    def failed() -> bool:
        found = versions(client, auth, model).get(version, {})
        return found.get("state") == "failed" and found.get("workers") == workers

    return failed


def all_ready_on(settings: Settings, model: str, version: int, workers: int) -> Callable[[], bool]:
    import redis

    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)

    def ready() -> bool:
        states = version_states(client, settings.key_prefix, model)
        others = [v for v, s in states.items() if v != version and s.state != "failed"]
        mine = states.get(version)
        return mine is not None and mine.state == "ready" and mine.workers == workers and not others

    return ready


def test_versions_switch_and_roll_back_under_load_and_a_broken_one_never_serves(
    reload_settings: Settings,
    sessions: sessionmaker[Session],
    auth: dict[str, str],
    admin: dict[str, str],
    tmp_path: Path,
) -> None:
    settings = reload_settings
    with ExitStack() as running:
        client = start_echo(running, settings, workers=2)
        load = start_load(running, client, auth)
        wait_until(lambda: len(load.accepted) >= 200)

        # A broken version: added, activated, refused by every worker; 1 keeps serving.
        add_version(tmp_path / "models", 3, BROKEN_PY)
        activate(client, admin, "echo", 3)

        # The API sees the activation within its poll interval, the workers' failure as it comes
        # (it is failed once both have refused it).
        wait_until(failed_on(client, auth, "echo", 3, workers=2))
        wait_until(lambda: versions(client, auth, "echo")[3]["active"])
        broken = versions(client, auth, "echo")[3]
        assert "weights are corrupt: checksum mismatch" in (broken["reason"] or ""), broken
        time.sleep(1.0)  # five polls: it is not tried again (its bytecode cache is no change)
        assert versions(client, auth, "echo")[3]["state"] == "failed"
        assert versions(client, auth, "echo")[1]["state"] == "ready"

        # Switch to 2 (the load goes on), then roll back to 1.
        activate(client, admin, "echo", 2)
        switched = wait_until(all_ready_on(settings, "echo", 2, 2))
        wait_until(lambda: len(load.ids(after=switched)) >= 200)
        rollback = time.monotonic()
        activate(client, admin, "echo", 1)
        rolled_back = wait_until(all_ready_on(settings, "echo", 1, 2))
        wait_until(lambda: len(load.ids(after=rolled_back)) >= 200)
        load.__exit__()  # the load stops first, then the workers finish what is queued
        rows = wait_terminal(sessions, load.ids(), timeout=120)
    assert not load.refused, load.refused[:3]
    assert len(rows) == len(load.accepted) >= 600
    statuses = {r.status for r in rows.values()}
    assert statuses == {"succeeded"}, {r.error for r in rows.values() if r.status != "succeeded"}
    # Exactly once, and the version recorded is the version that computed it.
    assert {r.attempts for r in rows.values()} == {1}
    outputs: dict[str, Any] = {job: row.output for job, row in rows.items()}
    assert all(outputs[j]["v"] == r.model_version for j, r in rows.items())
    by_version = {v: sum(r.model_version == v for r in rows.values()) for v in (1, 2, 3)}
    assert by_version[3] == 0 and by_version[1] > 0 and by_version[2] > 0, by_version
    # Jobs accepted once every worker served 2 (and before the rollback) ran on 2.
    assert {rows[j].model_version for j in load.ids(after=switched, before=rollback)} == {2}
    assert {rows[j].model_version for j in load.ids(after=rolled_back)} == {1}


def test_a_real_minilm_version_switch_keeps_every_job(
    settings: Settings,
    sessions: sessionmaker[Session],
    auth: dict[str, str],
    admin: dict[str, str],
    tmp_path: Path,
) -> None:
    # Version 2 is the same network stored in half precision: close, not identical.
    import torch
    from safetensors.torch import load_file, save_file

    root = tmp_path / "models" / "minilm"
    shutil.copytree(Path(__file__).resolve().parents[2] / "models" / "minilm", root)
    half = root / "2"
    shutil.copytree(minilm_files(), half, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(str(minilm_files() / "model.safetensors"))
    save_file({k: v.to(torch.float16).contiguous() for k, v in weights.items()},
              str(half / "model.safetensors"))  # fmt: skip
    text = (root / "model.toml").read_text()
    backend = 'backend = "sentence-transformers"'
    (root / "model.toml").write_text(text.replace(backend, backend + "\nactive_version = 1"))
    settings = settings.model_copy(
        update={"model_repository": tmp_path / "models", "models": "minilm",
                "model_parameters": {}, "model_poll_s": 0.2, "device": "cpu"}
    )  # fmt: skip
    texts = [f"sentence number {n} about ferries and queues" for n in range(40)]
    with ExitStack() as running:
        client = running.enter_context(TestClient(create_app(settings)))
        running.enter_context(RunningLoop(build_loop(settings, "minilm", name="minilm-1")))
        wait_until(all_ready_on(settings, "minilm", 1, 1), timeout=60)
        load = start_load(running, client, auth, "minilm", lambda n: texts[n % 40])
        wait_until(lambda: len(load.accepted) >= 40)
        activate(client, admin, "minilm", 2)
        switched = wait_until(all_ready_on(settings, "minilm", 2, 1), timeout=120)
        wait_until(lambda: len(load.ids(after=switched)) >= 40, timeout=60)
        load.__exit__()
        rows = wait_terminal(sessions, load.ids(), timeout=120)
    assert {r.status for r in rows.values()} == {"succeeded"}
    assert {r.attempts for r in rows.values()} == {1}
    assert {rows[j].model_version for j in load.ids(after=switched)} == {2}
    first = {r.model_version for r in rows.values()}
    assert first == {1, 2}
    with sessions() as session:
        reference: dict[tuple[str, int | None], Any] = {}
        for job in session.query(Job).filter(Job.id.in_(list(rows))):
            reference.setdefault((job.input, job.model_version), job.output)
    shared = [t for t in texts if (t, 1) in reference and (t, 2) in reference]
    assert shared, "no text ran on both versions"
    for t in shared:
        agreement = cosine(reference[(t, 1)], reference[(t, 2)])
        assert agreement >= 0.999, agreement
    assert any(reference[(t, 1)] != reference[(t, 2)] for t in shared)  # 2 really is another


def test_a_version_with_no_room_beside_the_old_restarts_one_worker_at_a_time(
    reload_settings: Settings,
    sessions: sessionmaker[Session],
    auth: dict[str, str],
    admin: dict[str, str],
) -> None:
    from backends.base import OutOfMemory

    settings = reload_settings

    def no_room(_config: object, _version: int) -> Any:
        # What a GPU says when two versions do not fit in its memory at once.
        raise OutOfMemory("CUDA out of memory. Tried to allocate 20.00 GiB")

    def crowded(name: str) -> Any:
        loop = build_loop(settings, "echo", name=name)
        assert loop.versions is not None
        loop.versions.load = no_room  # loading beside the serving version never fits
        return loop

    with ExitStack() as running:
        client = running.enter_context(TestClient(create_app(settings)))
        loops = {n: crowded(n) for n in ("echo-a", "echo-b")}
        runners = {n: RunningLoop(loop) for n, loop in loops.items()}
        for runner in runners.values():
            running.enter_context(runner)
        wait_until(all_ready_on(settings, "echo", 1, 2))
        load = start_load(running, client, auth)
        wait_until(lambda: len(load.accepted) >= 100)
        activate(client, admin, "echo", 2)

        # One worker stops to restart; the other keeps serving 1 until that one is back.
        first = wait_until_one(lambda: [n for n, lp in loops.items() if lp.restart_requested])[0]
        other = next(n for n in loops if n != first)
        wait_until(lambda: not runners[first].thread.is_alive())
        time.sleep(1.0)  # several polls: the other worker waits for its turn
        assert not loops[other].restart_requested
        assert loops[other].version == 1
        # Its process starts again (ferry up does this on exit code 76): version 2, alone.
        restarted = running.enter_context(RunningLoop(build_loop(settings, "echo", name=first)))
        assert restarted.version == 2
        wait_until(lambda: loops[other].restart_requested)
        wait_until(lambda: not runners[other].thread.is_alive())
        running.enter_context(RunningLoop(build_loop(settings, "echo", name=other)))
        done = wait_until(all_ready_on(settings, "echo", 2, 2))
        wait_until(lambda: len(load.ids(after=done)) >= 100)
        load.__exit__()
        rows = wait_terminal(sessions, load.ids(), timeout=120)
    assert {r.status for r in rows.values()} == {"succeeded"}
    assert {r.attempts for r in rows.values()} == {1}
    outputs: dict[str, Any] = {job: row.output for job, row in rows.items()}
    assert all(outputs[j]["v"] == r.model_version for j, r in rows.items())
    assert {rows[j].model_version for j in load.ids(after=done)} == {2}


def wait_until_one(probe: Callable[[], list[str]], timeout: float = 30.0) -> list[str]:
    until = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            assert len(found) == 1, found  # one worker at a time
            return found
        assert time.monotonic() < until, "timed out"
        time.sleep(0.02)


FAILING_PY = """
from pathlib import Path
from typing import Any


class Echo:
    def __init__(self, files: Path, parameters: dict[str, Any], device: str) -> None:
        self.version = int((files / "VERSION").read_text())

    def predict(self, inputs: list[int]) -> list[dict[str, int]]:
        # A deploy that builds and loads, then cannot compute (an op the device lacks).
        raise RuntimeError("no kernel image is available for execution on the device")
"""

PICKY_PY = """
from pathlib import Path
from typing import Any


class Echo:
    def __init__(self, files: Path, parameters: dict[str, Any], device: str) -> None:
        self.version = int((files / "VERSION").read_text())

    def predict(self, inputs: list[int]) -> list[dict[str, int]]:
        if any(x < 0 for x in inputs):
            raise ValueError("negative input")
        return [{"v": self.version, "x": x} for x in inputs]
"""


def test_a_version_that_loads_and_fails_every_batch_is_rolled_back_and_no_job_fails(
    reload_settings: Settings,
    sessions: sessionmaker[Session],
    auth: dict[str, str],
    admin: dict[str, str],
    tmp_path: Path,
) -> None:
    settings = reload_settings.model_copy(update={"rollback_after_failed_batches": 3})
    with ExitStack() as running:
        client = start_echo(running, settings, workers=2)
        load = start_load(running, client, auth)
        wait_until(lambda: len(load.accepted) >= 100)

        add_version(tmp_path / "models", 3, FAILING_PY)
        activated = time.monotonic()
        activate(client, admin, "echo", 3)
        wait_until(failed_on(client, auth, "echo", 3, workers=2))  # rolled back by both
        rolled_back = time.monotonic()
        wait_until(lambda: len(load.ids(after=rolled_back)) >= 100)
        load.__exit__()
        rows = wait_terminal(sessions, load.ids(), timeout=120)
        bad = versions(client, auth, "echo")[3]
        after = versions(client, auth, "echo")
    assert not load.refused, load.refused[:3]
    # No job failed for the bad deploy: every one ran on version 1, once or (the jobs of
    # the batches version 3 failed) twice, the second time on version 1.
    statuses = {r.status for r in rows.values()}
    assert statuses == {"succeeded"}, {r.error for r in rows.values() if r.status != "succeeded"}
    assert {r.model_version for r in rows.values()} == {1}
    assert all((r.output or {}).get("v") == 1 for r in rows.values())
    tried = [j for j, r in rows.items() if r.attempts == 2]
    assert tried and {r.attempts for r in rows.values()} == {1, 2}
    # Those are jobs accepted after the activation: the ones version 3 was given.
    accepted_at = {j: at for at, j in load.accepted}
    assert all(accepted_at[j] >= activated - 1.0 for j in tried)
    # Failed, with what it failed on, and 1 serves again on both workers (3 stays active:
    # the operator's activation is theirs to change).
    with sessions() as session:
        activation = session.get(ModelActivation, "echo")
    assert activation is not None and activation.version == 3
    assert "no kernel image is available" in (bad["reason"] or ""), bad
    assert "rolled back to version 1" in bad["reason"], bad
    assert after[1]["state"] == "ready" and after[1]["workers"] == 2, after[1]


def test_a_version_that_fails_some_inputs_only_is_kept_and_those_jobs_fail(
    reload_settings: Settings,
    sessions: sessionmaker[Session],
    auth: dict[str, str],
    admin: dict[str, str],
    tmp_path: Path,
) -> None:
    add_version(tmp_path / "models", 3, PICKY_PY)
    settings = reload_settings.model_copy(update={"rollback_after_failed_batches": 2})
    with ExitStack() as running:
        client = start_echo(running, settings, workers=1)
        activate(client, admin, "echo", 3)
        wait_until(lambda: versions(client, auth, "echo")[3]["state"] == "ready")

        def submit(x: int) -> str:
            response = client.post("/v1/jobs", json={"model": "echo", "input": x}, headers=auth)
            job_id: str = response.json()["id"]
            return job_id

        def run(x: int) -> str:
            job_id = submit(x)
            wait_terminal(sessions, [job_id], timeout=30)
            return job_id

        def status(job_id: str) -> str:
            with sessions() as session:
                job = session.get(Job, job_id)
                return job.status if job is not None else ""

        # One batch failed whole (held, still running: one of the two that would roll the
        # version back), then one that computes: the version is kept, and the held job's
        # failure is recorded as its input's own.
        on_trial = submit(-1)
        wait_until(lambda: status(on_trial) == "running")
        time.sleep(0.5)  # judged and held: it stays running
        assert status(on_trial) == "running"
        good = [run(x) for x in range(3)]
        # Version 1, kept loaded during the trial, is dropped once it is over.
        wait_until(all_ready_on(settings, "echo", 3, 1))
        # Off trial, a batch failed whole is an input's failure as before.
        bad_ids = [on_trial] + [run(x) for x in (-2, -3, -4)]
        rows = wait_terminal(sessions, bad_ids + good, timeout=60)
    assert {rows[j].status for j in bad_ids} == {"failed"}, [rows[j].error for j in bad_ids]
    assert all("negative input" in (rows[j].error or "") for j in bad_ids)
    assert {rows[j].status for j in good} == {"succeeded"}
    assert {rows[j].model_version for j in bad_ids + good} == {3}
    assert {rows[j].attempts for j in bad_ids + good} == {1}
