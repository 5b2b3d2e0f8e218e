"""A process that starts ``ferry`` commands as forks of itself, for a stack of the harness.

A stack of the fault suite starts an API, workers and a Celery worker, and starts them
again after each kill: every one a new interpreter importing the same second of CPU of
modules. The zygote imports them once (what ``ferry up`` imports before it forks its
children: ``ferry.up.CHILD_MODULES``) and forks each command from there
(``ferry.children.fork_ferry``), as ``ferry up`` does. It is its own process, not the
test's: pytest's has threads (xdist's, the harness's), and a fork of a process with
threads may inherit a lock one of them held.

The zygote's children are its own, so it reaps them and says how each ended; the
harness sees them through ``ZygoteChild``, which answers as ``subprocess.Popen`` does
(``poll``, ``wait``, ``send_signal``, ``kill``). Each runs in a session of its own, its
output appended to its log, in its working directory, with the environment it was
given, and gets SIGTERM if the zygote dies.

Protocol, a JSON object per line: the harness writes ``{"args", "env", "cwd", "log"}``
to the zygote's stdin; the zygote writes ``{"started": pid}`` for each, in order, and
``{"exited": pid, "code": code}`` (``Popen.returncode``'s sense) when one ends.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from ferry.children import Signalled

# How often the zygote looks for children that ended, between requests.
REAP_S = 0.05
ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0


def _redirected(cwd: str, log: str) -> None:
    """In the fork: its working directory, stdin from /dev/null, stdout and stderr to
    ``log`` (the zygote's own are its pipes to the harness)."""
    os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)


def serve() -> None:
    """The zygote: requests on stdin, what became of them on stdout, until stdin closes."""
    from ferry.children import fork_ferry
    from ferry.up import CHILD_MODULES

    for module in ("ferry.cli", *CHILD_MODULES):
        importlib.import_module(module)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    pending = b""
    out = sys.stdout

    def say(message: dict[str, int]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    while True:
        if selector.select(timeout=REAP_S):
            data = os.read(0, 1 << 16)
            if not data:
                return  # the harness is gone: its children get SIGTERM as the zygote exits
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                own = functools.partial(_redirected, request["cwd"], request["log"])
                child = fork_ferry(request["args"], request["env"], own)
                say({"started": child.pid})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


class Zygote:
    """The harness's end: a zygote started with ``env`` (the stack's), its own log ``log``."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self._log = log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "harness.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=ROOT,  # where `harness` is imported from (each fork goes to its own cwd)
            start_new_session=True,
        )
        self._started: queue.Queue[int] = queue.Queue()
        self._ended = threading.Condition()
        self.codes: dict[int, int] = {}
        self.gone = False
        self._send = threading.Lock()
        threading.Thread(target=self._read, name="zygote", daemon=True).start()

    def _read(self) -> None:
        stdout: IO[bytes] | None = self.process.stdout
        assert stdout is not None
        for line in stdout:
            message: dict[str, Any] = json.loads(line)
            if "started" in message:
                with self._ended:  # a pid used again: what it was before is not this one
                    self.codes.pop(int(message["started"]), None)
                self._started.put(int(message["started"]))
            else:
                with self._ended:
                    self.codes[int(message["exited"])] = int(message["code"])
                    self._ended.notify_all()
        with self._ended:
            self.gone = True  # its children got SIGTERM: none will be reported now
            self._ended.notify_all()

    def spawn(self, args: list[str], env: dict[str, str], cwd: Path, log: Path) -> ZygoteChild:
        """``python -m ferry ARGS`` forked by the zygote."""
        request = {"args": args, "env": env, "cwd": str(cwd), "log": str(log)}
        with self._send:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            try:
                pid = self._started.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                said = f"the zygote started nothing in {START_TIMEOUT_S:g} s"
                raise RuntimeError(f"{said} (its log: {self._log.name})") from None
        return ZygoteChild(self, pid, [sys.executable, "-m", "ferry", *args])

    def code(self, pid: int, timeout: float | None) -> int | None:
        """How ``pid`` ended, waiting up to ``timeout`` (None: without end; 0: not at all)."""
        with self._ended:
            self._ended.wait_for(lambda: pid in self.codes or self.gone, timeout)
            if pid in self.codes:
                return self.codes[pid]
            return -signal.SIGTERM if self.gone else None

    def close(self) -> None:
        """Stop the zygote (any child still running gets SIGTERM)."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


class ZygoteChild(Signalled):
    """A child of the zygote, as the harness uses a ``subprocess.Popen``."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode


if __name__ == "__main__":
    serve()
