"""Version states in Redis, activations in the database, and the version manager's decisions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker

from backends.base import HostRuntime
from core.config.settings import Settings
from core.db.versions import activate, active_version, report, version_states
from core.models.repository import ModelConfig
from core.streams.protocol import workers_key
from tests.integration.test_hot_reload import echo_repository
from workers.gpu.versions import Loaded, VersionManager


class Stub(HostRuntime):
    name = "echo"

    def __init__(self, version: int) -> None:
        self.version = version

    def load(self) -> None:
        return None

    def compute(self, prepared: list[int]) -> list[int]:
        return prepared


def test_states_are_gathered_over_the_live_workers(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    now = time.time()
    client.zadd(workers_key(key_prefix, "m"), {"a": now, "b": now, "gone": now - 3600})
    report(client, key_prefix, "m", "a", 1, "ready")
    report(client, key_prefix, "m", "b", 1, "draining")
    report(client, key_prefix, "m", "b", 2, "loading")
    report(client, key_prefix, "m", "a", 3, "failed", "bad weights")
    report(client, key_prefix, "m", "gone", 4, "ready")  # a dead worker's: not shown
    report(client, key_prefix, "m", "gone", 5, "failed", "out of memory")  # shown a while
    states = version_states(client, key_prefix, "m")
    assert {v: (s.state, s.workers) for v, s in states.items()} == {
        1: ("ready", 1), 2: ("loading", 1), 3: ("failed", 1), 5: ("failed", 1),
    }  # fmt: skip
    assert (states[3].reason, states[5].reason) == ("bad weights", "out of memory")
    report(client, key_prefix, "m", "a", 1, None)  # a unloads version 1
    assert version_states(client, key_prefix, "m")[1].state == "draining"
    later = version_states(client, key_prefix, "m", now=now + 7200)
    assert 5 not in later  # an old failure of a gone worker is forgotten


def read_echo(root: Path) -> ModelConfig:
    """The echo model as the repository under ``root`` holds it now."""
    from backends.catalog import repository_for

    return repository_for(Settings(model_repository=root, models="echo"))["echo"]


@dataclass
class Echo:
    """The echo model's repository, built under the test's folder, beside the database and
    the Redis its versions are followed in."""

    model: ModelConfig
    root: Path
    base: Settings
    sessions: sessionmaker[Session]
    redis: redis.Redis
    key_prefix: str

    def files(self, version: int) -> Path:
        return self.root / "echo" / str(version)

    def settings(self, **update: Any) -> Settings:
        """The test's settings serving this repository (and ``update``)."""
        return self.base.model_copy(
            update={"model_repository": self.root, "models": "echo", "model_parameters": {}}
            | update
        )

    def activate(self, version: int) -> None:
        with self.sessions() as session:
            activate(session, self.model, version)

    def manager(self, load: Callable[[ModelConfig, int], Loaded], **options: Any) -> VersionManager:
        """Worker "w"'s manager, serving version 1, loading another with ``load``."""
        return VersionManager(
            "echo",
            Loaded(1, Stub(1)),
            lambda: read_echo(self.root),
            load,
            self.sessions,
            self.redis,
            self.key_prefix,
            "w",
            poll_s=0.0,
            **options,
        )


@pytest.fixture
def echo(
    settings: Settings,
    sessions: sessionmaker[Session],
    redis_url: str,
    key_prefix: str,
    tmp_path: Path,
) -> Iterator[Echo]:
    root = tmp_path / "models"
    echo_repository(root)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield Echo(read_echo(root), root, settings, sessions, client, key_prefix)
    client.close()


def test_an_activation_wins_only_for_a_version_in_the_repository(echo: Echo) -> None:
    model = echo.model
    with echo.sessions() as session:
        assert active_version(session, model) == 1  # model.toml's active_version
        activate(session, model, 2)
        assert active_version(session, model) == 2
        gone = ModelConfig(**{**model.__dict__, "versions": {1: model.versions[1]}})
        assert active_version(session, gone) == 1  # version 2's folder was removed


def test_the_manager_loads_the_active_version_once_and_does_not_retry_a_failure(
    echo: Echo,
) -> None:
    loads: list[int] = []

    def load(config: ModelConfig, version: int) -> Loaded:
        loads.append(version)
        if (config.versions[version].files / "BROKEN").exists():
            raise ValueError("cannot load: BROKEN\nsecond line not shown")
        return Loaded(version, Stub(version))

    client, key_prefix = echo.redis, echo.key_prefix
    client.zadd(workers_key(key_prefix, "echo"), {"w": time.time()})
    manager = echo.manager(load)
    manager.start()
    assert manager.poll() is None and loads == []  # 1 is active and served

    broken = echo.files(2) / "BROKEN"
    broken.write_text("x")
    echo.activate(2)
    assert manager.poll() is None  # the load starts on its thread
    assert until(lambda: manager.poll() is None and manager.failed(2))
    states = version_states(client, key_prefix, "echo")
    assert (states[2].state, states[2].reason) == ("failed", "cannot load: BROKEN")
    assert states[1].state == "ready"
    for _ in range(5):
        assert manager.poll() is None
    assert loads == [2]  # not tried again while nothing changed

    broken.unlink()  # the version's files changed: it is tried again, and loads
    loaded = until(manager.poll)
    assert isinstance(loaded, Loaded) and loaded.version == 2 and loads == [2, 2]
    old = manager.switched(loaded)
    assert old.version == 1
    assert version_states(client, key_prefix, "echo")[1].state == "draining"
    manager.unloaded(old)
    assert set(version_states(client, key_prefix, "echo")) == {2}
    manager.stop()


def until(probe: object, timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = probe()  # type: ignore[operator]
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_a_job_pinned_to_a_version_no_longer_active_fails_and_says_why(
    echo: Echo, auth: dict[str, str]
) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from tests.integration.conftest import RunningLoop, submit, wait_terminal
    from workers.gpu.main import build_loop

    live = echo.settings(model_poll_s=0.1)
    with TestClient(create_app(live)) as client:
        old = submit(client, auth, model="echo@1", input=7)
        echo.activate(2)
        with RunningLoop(build_loop(live, "echo", name="echo-w")):
            new = submit(client, auth, model="echo", version=2, input=8)
            rows = wait_terminal(echo.sessions, [old, new], timeout=30)
        assert (rows[old].status, rows[old].error) == (
            "failed", "version 1 of echo is not served now (the active version is 2; serving 2)",
        )  # fmt: skip
        assert (rows[new].status, rows[new].model_version, rows[new].requested_version) == (
            "succeeded", 2, 2,
        )  # fmt: skip
        assert rows[new].output == {"v": 2, "x": 8}
        refused = client.post("/v1/jobs", json={"model": "echo@1", "input": 1}, headers=auth)
        assert refused.status_code == 422
        assert "echo@1 takes no jobs; its active version is 2" in refused.text


def test_a_rollback_while_waiting_to_restart_cancels_the_restart(echo: Echo) -> None:
    from backends.base import OutOfMemory

    loads: list[int] = []

    def no_room(_config: ModelConfig, version: int) -> Loaded:
        loads.append(version)
        raise OutOfMemory("CUDA out of memory")

    manager = echo.manager(no_room)
    echo.activate(2)
    assert manager.poll() is None
    until(lambda: manager.poll() is None and manager.restart_for == 2)
    for _ in range(5):  # waiting for its turn: no load is tried again meanwhile
        assert manager.poll() is None
    assert loads == [2]
    echo.activate(1)  # rolled back to the version it serves
    assert manager.poll() is None and manager.restart_for is None
    assert loads == [2]


def test_a_version_that_does_not_load_even_alone_is_not_tried_again(echo: Echo) -> None:
    from tests.integration.conftest import RunningLoop
    from workers.gpu.main import build_loop

    (echo.files(2) / "echo.py").write_text(
        "class Echo:\n    def __init__(self, files, parameters, device):\n"
        "        raise MemoryError('CUDA out of memory (even alone)')\n"
    )
    echo.activate(2)
    live = echo.settings(model_poll_s=0.05)
    # The process a restart makes: version 2 fails alone, so it serves model.toml's 1.
    loop = build_loop(live, "echo", name="echo-w")
    assert loop.version == 1 and loop.versions is not None and loop.versions.failed(2)
    with RunningLoop(loop):
        time.sleep(0.5)  # ten polls
        assert not loop.restart_requested and loop.versions.restart_for is None
        states = version_states(loop.client, live.key_prefix, "echo")
        assert states[2].state == "failed"
        assert "does not load even alone: CUDA out of memory (even alone)" in (
            states[2].reason or ""
        )


def test_the_api_reads_versions_once_when_workers_do_not_follow_them(echo: Echo) -> None:
    from backends.catalog import LiveVersions, build_catalog

    fixed = echo.settings(model_poll_s=0)
    spec = build_catalog(fixed)["echo"]
    live = LiveVersions(fixed, echo.sessions, fixed.model_poll_s)
    assert live.of(spec) == ((1, 2), 1)
    echo.activate(2)
    assert live.of(spec) == ((1, 2), 1)  # read once: the workers will not switch either
    following = LiveVersions(fixed, echo.sessions, 0.01)
    assert following.of(spec) == ((1, 2), 2)


def test_a_job_pinned_to_a_version_just_activated_waits_for_it(
    echo: Echo, auth: dict[str, str]
) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from tests.integration.conftest import RunningLoop, submit, wait_terminal
    from workers.gpu.main import build_loop

    api = echo.settings(model_poll_s=0.01)
    # A worker that would not look for an activation for a minute by itself.
    worker = echo.settings(model_poll_s=60.0)
    with TestClient(create_app(api)) as client, RunningLoop(build_loop(worker, "echo", name="w")):
        echo.activate(2)
        time.sleep(0.05)  # the API has seen it; the worker has not
        pinned = submit(client, auth, model="echo@2", input=5)
        rows = wait_terminal(echo.sessions, [pinned], timeout=30)
    assert (rows[pinned].status, rows[pinned].model_version) == ("succeeded", 2), rows[pinned].error
    assert rows[pinned].output == {"v": 2, "x": 5}


def test_a_load_that_hangs_is_given_up_and_does_not_block_the_next(echo: Echo) -> None:
    release = threading.Event()
    hang = [True]

    def load(_config: ModelConfig, version: int) -> Loaded:
        if hang[0]:
            release.wait(30)  # a user's __init__ that never returns, as far as Ferry knows
        return Loaded(version, Stub(version))

    echo.redis.zadd(workers_key(echo.key_prefix, "echo"), {"w": time.time()})
    manager = echo.manager(load, load_timeout_s=0.2)
    try:
        echo.activate(2)
        assert manager.poll() is None
        until(lambda: manager.poll() is None and manager.failed(2))
        state = version_states(echo.redis, echo.key_prefix, "echo")[2]
        assert (state.state, state.reason) == ("failed", "did not load within 0.2 s")
        # The version's files change (a fixed build): it is tried again, and loads.
        hang[0] = False
        (echo.files(2) / "FIXED").write_text("x")
        loaded = until(manager.poll)
        assert isinstance(loaded, Loaded) and loaded.version == 2
    finally:
        release.set()


def test_a_failed_python_version_is_not_retried_because_its_bytecode_was_written(
    echo: Echo,
) -> None:
    from workers.gpu.versions import signature

    model = echo.model
    before = signature(model, 2)
    cache = echo.files(2) / "__pycache__"
    cache.mkdir()
    (cache / "echo.cpython-311.pyc").write_bytes(b"x")  # what importing the module leaves
    assert signature(model, 2) == before
    (echo.files(2) / "echo.py").write_text("class Echo: ...\n")
    assert signature(model, 2) != before  # a change of its own files is one


def test_live_versions_answer_from_the_last_read_and_read_again_before_refusing(
    echo: Echo,
) -> None:
    """Past the first read, a question never waits for the repository or the database: it
    is answered from the last read while the next runs in a thread (they were read on the
    API's event loop once a second); a request about to be refused reads again first."""
    from api.models.service import resolve_model
    from backends.catalog import LiveVersions, build_catalog

    served = echo.settings()
    catalog = build_catalog(served)
    spec = catalog["echo"]
    opened: list[str] = []

    def counted() -> Session:
        opened.append(threading.current_thread().name)
        return echo.sessions()

    live = LiveVersions(served, counted, poll_s=0.2)  # type: ignore[arg-type]
    assert live.of(spec) == ((1, 2), 1)  # the first read: waited for, on the caller's thread
    assert opened == [threading.current_thread().name]
    echo.activate(2)  # as another API process would
    time.sleep(0.25)
    assert live.of(spec) == ((1, 2), 1)  # a poll old: answered from it, the next read begun
    until(lambda: live.of(spec) == ((1, 2), 2))
    assert opened[1:] and all(name == "versions" for name in opened[1:])
    echo.activate(1)
    time.sleep(0.25)
    # The last read says 2 is active; before refusing echo@1 it reads again, and takes it.
    assert resolve_model(catalog, "echo@1", live=live) == (spec, 1)
