"""harness.zygote: ``ferry`` commands forked by a zygote, seen as Popen-like children."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import running
from harness.zygote import Zygote


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    started = Zygote(dict(os.environ), tmp_path / "zygote.log")
    try:
        yield started
    finally:
        started.close()


def test_a_command_runs_in_its_directory_with_its_environment_and_log(
    zygote: Zygote, tmp_path: Path
) -> None:
    # The repository it checks is named by its environment, relative to its directory.
    here = tmp_path / "here"
    (here / "repo").mkdir(parents=True)
    env = dict(os.environ, FERRY_MODEL_REPOSITORY="repo")
    child = zygote.spawn(["models", "check"], env, here, tmp_path / "check.log")
    assert child.wait(timeout=60) == 1
    assert "repo: holds no model folder" in (tmp_path / "check.log").read_text()
    usage = zygote.spawn(["no-such-command"], dict(os.environ), tmp_path, tmp_path / "usage.log")
    assert usage.wait(timeout=60) == 2
    assert "no-such-command" in (tmp_path / "usage.log").read_text()


def test_a_running_child_times_out_is_killed_and_is_then_signalled_no_more(
    zygote: Zygote, tmp_path: Path
) -> None:
    # Celery beat retries a broker that never answers: it runs until stopped.
    env = dict(os.environ, FERRY_REDIS_URL="redis://127.0.0.1:1/0")
    child = zygote.spawn(["celery", "beat"], env, tmp_path, tmp_path / "beat.log")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=1)
    assert child.poll() is None
    assert os.getsid(child.pid) == child.pid  # a session of its own
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.send_signal(signal.SIGTERM)  # ended: its pid is no longer its own
    assert child.poll() == -signal.SIGKILL


def test_the_children_of_a_closed_zygote_are_stopped(tmp_path: Path) -> None:
    zygote = Zygote(dict(os.environ), tmp_path / "zygote.log")
    env = dict(os.environ, FERRY_REDIS_URL="redis://127.0.0.1:1/0")
    child = zygote.spawn(["celery", "beat"], env, tmp_path, tmp_path / "beat.log")
    zygote.close()
    child.wait(timeout=30)  # no longer known to the harness: its zygote is gone
    # The kernel's SIGTERM as the zygote exits (stop_with_parent): nothing runs on.
    until = time.monotonic() + 30
    while running(child.pid):
        assert time.monotonic() < until, f"{child.pid} still runs"
        time.sleep(0.1)
