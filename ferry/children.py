"""The processes a Ferry supervisor starts (``ferry up``, ``ferry api`` with several
processes): stopped by the kernel when the supervisor dies, however it dies.

A supervisor stops its children in order on SIGTERM or Ctrl-C; one that is killed
(SIGKILL, the OOM killer) or crashes cannot. Without this its children would run on
with no one to stop them: the API still bound to its port, the workers and Celery
retrying a Redis that went with it, each spinning on its reconnects.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's prctl, looked up in the parent: the child between fork and exec must not
    load a library (another thread may have held the loader's lock at the fork)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: the supervisor's own stop signals are all there is


_PRCTL = _prctl()


def stop_with_parent() -> None:
    """``preexec_fn`` of a child: SIGTERM when the thread that started it ends (Linux).

    The supervisors start their children from their main thread, so that is when the
    supervisor itself ends.
    """
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess(Protocol):
    """What a supervisor needs of a child: ``subprocess.Popen`` or ``Forked``."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Signalled:
    """``send_signal``, ``terminate`` and ``kill`` as ``subprocess.Popen``'s, for a child
    known by its ``pid`` and ``poll``."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        # Never once it has ended: its pid may already be another process's.
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forked(Signalled):
    """A child started by ``fork_ferry``: the parts of ``subprocess.Popen`` a supervisor uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def _reaped(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reaped(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            code = self._reaped(0)
            assert code is not None
            return code
        until = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= until:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return code


def fork_ferry(
    args: list[str], env: dict[str, str], own: Callable[[], None] | None = None
) -> Forked:
    """``python -m ferry ARGS`` as a fork of this process, in a session of its own and
    stopped with its parent, as ``subprocess.Popen(..., start_new_session=True,
    preexec_fn=stop_with_parent)`` would start it.

    The fork already holds every module its parent imported, so it starts without a new
    interpreter and without importing again what the two share (about a second of CPU
    for each of ``ferry up``'s children). Its parent must have no other thread (a lock
    one holds would stay held in the fork) and must not have started the model runtime
    (torch's threads and CUDA do not survive a fork). In the fork, the parent's signal
    handlers are reset, the environment becomes ``env`` and the settings the parent had
    read from its own are dropped; then ``own``, where given, does what else the fork's
    caller needs (the harness's zygote moves the fork's directory and output), and the
    command runs. ``ps`` shows ``python -m ferry
    ARGS`` (one string, the arguments parted by spaces).
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        return Forked(pid, [sys.executable, "-m", "ferry", *args])
    code = 1
    try:
        os.setsid()
        stop_with_parent()
        # Before the environment changes: setproctitle finds the room for a title in the
        # argument and environment strings exec left, which a cleared environment moves.
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.setproctitle(shlex.join([sys.executable, "-m", "ferry", *args]))
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        # Read again from the fork's environment (its data dir, Redis, database, secrets).
        from core.config.settings import get_settings

        get_settings.cache_clear()
        if own is not None:
            own()
        sys.argv = [sys.argv[0], *args]
        from ferry.cli import main

        code = main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        # What the interpreter does at its exit, then out without unwinding into the
        # parent's stack (its finally blocks would stop the parent's children).
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)
