"""ferry.children.fork_ferry: a ``ferry`` command run as a fork, waited for like a Popen.

Each case forks from a fresh interpreter of its own: the pytest process has threads
(xdist's), and a fork of it could inherit a lock one of them holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from harness.processes import command_line

ROOT = Path(__file__).resolve().parents[2]


def forked(body: str, tmp_path: Path) -> dict[str, Any]:
    """Run ``body`` (with ``fork_ferry``, ``seen``, ``Path``, ``os`` in scope) in a new
    interpreter; what it leaves in ``out`` (a dict) comes back."""
    script = (
        textwrap.dedent(
            """
        import json, os, signal, subprocess, sys, time
        from pathlib import Path
        from ferry.children import fork_ferry
        seen = Path(sys.argv[1])
        out = {}
        """
        )
        + textwrap.dedent(body)
        + "\nprint(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "seen")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_fork_runs_the_command_in_its_own_session_and_environment(tmp_path: Path) -> None:
    out = forked(
        """
        def own():
            seen.write_text(json.dumps({
                "env": dict(os.environ), "session": os.getsid(0), "pid": os.getpid(),
                "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            }))
        signal.signal(signal.SIGTERM, lambda *_: None)  # the parent's, not the child's
        child = fork_ferry(["models", "--help"], {"ONLY": "this", "PATH": os.environ["PATH"]}, own)
        out["code"] = child.wait(timeout=60)
        out["pid"] = child.pid
        out["child"] = json.loads(seen.read_text())
        out["session"] = os.getsid(0)
        """,
        tmp_path,
    )
    assert out["code"] == 0
    child = out["child"]
    assert child["env"] == {"ONLY": "this", "PATH": child["env"]["PATH"]}
    assert child["pid"] == out["pid"] and child["session"] == out["pid"] != out["session"]
    assert child["sigterm"] is True


def test_the_fork_reads_its_settings_from_its_own_environment(tmp_path: Path) -> None:
    out = forked(
        """
        from core.config.settings import get_settings
        os.environ["FERRY_DATA_DIR"] = str(seen.parent / "parent")
        out["parent"] = str(get_settings().data_dir)  # read, and cached, before the fork
        def own():
            seen.write_text(str(get_settings().data_dir))
        env = {"PATH": os.environ["PATH"], "FERRY_DATA_DIR": str(seen.parent / "child")}
        out["code"] = fork_ferry(["models", "--help"], env, own).wait(timeout=60)
        out["child"] = seen.read_text()
        """,
        tmp_path,
    )
    assert out["code"] == 0
    assert out["parent"] == str(tmp_path / "parent")
    assert out["child"] == str(tmp_path / "child")


def test_a_commands_exit_status_is_the_forks(tmp_path: Path) -> None:
    out = forked(
        """
        child = fork_ferry(["no-such-command"], dict(os.environ), lambda: None)
        out["usage"] = child.wait()
        child = fork_ferry(["models", "--help"], dict(os.environ), lambda: sys.exit(7))
        out["exit"] = child.wait()
        child = fork_ferry(["models", "--help"], dict(os.environ), lambda: 1 / 0)
        out["raised"] = child.wait()
        """,
        tmp_path,
    )
    assert out == {"usage": 2, "exit": 7, "raised": 1}


def test_a_running_fork_times_out_is_killed_and_then_is_signalled_no_more(
    tmp_path: Path,
) -> None:
    out = forked(
        """
        child = fork_ferry(["models", "--help"], dict(os.environ), lambda: time.sleep(60))
        try:
            child.wait(timeout=0.2)
            out["timed_out"] = False
        except subprocess.TimeoutExpired:
            out["timed_out"] = True
        out["running"] = child.poll()
        child.kill()
        out["killed"] = child.wait(timeout=30)
        child.send_signal(signal.SIGTERM)  # reaped: its pid is no longer its own
        out["after"] = child.poll()
        """,
        tmp_path,
    )
    assert out == {"timed_out": True, "running": None, "killed": -9, "after": -9}


def test_ps_shows_the_forks_command(tmp_path: Path) -> None:
    """Its command line reads as ``python -m ferry ARGS`` (to ps, and to the harness's
    ``command_line``), not as its parent's."""
    out = forked(
        """
        import ferry.cli
        def own():  # the command itself: a wait, to be looked at meanwhile
            ferry.cli.main = lambda args: time.sleep(60) or 0
        child = fork_ferry(["worker", "--model", "sim"], dict(os.environ), own)
        until = time.monotonic() + 30
        title = sys.executable.encode() + b" -m"  # until then, its parent's (exec's form)
        while not (raw := Path(f"/proc/{child.pid}/cmdline").read_bytes()).startswith(title):
            assert time.monotonic() < until, raw
            time.sleep(0.02)
        out["raw"] = raw.rstrip(b"\\0").decode()
        child.kill()
        child.wait()
        """,
        tmp_path,
    )
    args = command_line(out["raw"].encode())
    assert args == [sys.executable, "-m", "ferry", "worker", "--model", "sim"]
    assert command_line(b"/usr/bin/python3\0-m\0ferry\0api\0") == [
        "/usr/bin/python3",
        "-m",
        "ferry",
        "api",
    ]
