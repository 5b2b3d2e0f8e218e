"""``python -m ferry ...`` processes as an operator starts them: logged, supervised, killed.

Each process runs in a session of its own, so a signal meant for the harness
never reaches it and a kill reaches exactly it (and anything it forked). A process
whose environment adds only Ferry's settings (FERRY_*) is forked by the stack's zygote
(harness.zygote), as ``ferry up`` forks its children; one that adds anything read as
the interpreter starts (a ``PYTHONPATH`` with a sitecustomize, an ``LD_PRELOAD``) is a
new interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.children import ChildProcess
from harness import POLL_S
from harness.zygote import Zygote


@dataclass
class Proc:
    """One `python -m ferry ...` process (restarted in place when supervised)."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    supervised: bool = False
    # Forked by the zygote (its environment adds only FERRY_* settings), else exec'd.
    forked: bool = False
    popen: ChildProcess | None = None
    exits: list[int] = field(default_factory=list)
    starts: int = 0

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Processes:
    """The processes of one stack, started in ``tmp``, each logging to ``tmp/<name>.log``.

    A supervised process that exits is restarted in place, as `ferry up` does
    (without its backoff); ``stop_processes()`` kills every one ever started.
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env: dict[str, str] = {}  # what every process gets, set before the first spawn
        self.procs: dict[str, Proc] = {}
        self._all: list[ChildProcess] = []
        self._zygote: Zygote | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)

    def supervise(self) -> None:
        self._supervisor.start()

    def spawn(self, name: str, args: list[str], supervised: bool = False, **env: str) -> Proc:
        proc = Proc(
            name=name,
            args=[sys.executable, "-m", "ferry", *args],
            env={**self.env, **env},
            log=self.tmp / f"{name}.log",
            supervised=supervised,
            forked=all(key.startswith("FERRY_") for key in env),
        )
        with self._lock:
            self.procs[name] = proc
            self._launch(proc)
        return proc

    def _launch(self, proc: Proc) -> None:
        proc.starts += 1
        with proc.log.open("ab") as log:
            log.write(f"--- start {proc.starts} at {time.time():.3f}\n".encode())
            if proc.forked:
                log.flush()  # before the fork's first line
                if self._zygote is None:
                    self._zygote = Zygote(self.env, self.tmp / "zygote.log")
                proc.popen = self._zygote.spawn(proc.args[3:], proc.env, self.tmp, proc.log)
                self._all.append(proc.popen)
                return
            # A session of its own: a signal for the harness never reaches it, and
            # teardown can kill exactly this process (and anything it forked).
            proc.popen = subprocess.Popen(
                proc.args,
                env=proc.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.tmp,
                start_new_session=True,
            )
        self._all.append(proc.popen)

    def _supervise(self) -> None:
        """Restart supervised processes that exit, as `ferry up` does (no backoff)."""
        while not self._stop.wait(POLL_S):
            with self._lock:
                for proc in self.procs.values():
                    if proc.supervised and proc.popen is not None:
                        code = proc.popen.poll()
                        if code is not None:
                            proc.exits.append(code)
                            self._launch(proc)

    def signal(self, proc: Proc, signum: int) -> None:
        assert proc.popen is not None
        proc.popen.send_signal(signum)

    def kill(self, proc: Proc) -> int:
        """kill -9, and no restart."""
        with self._lock:
            proc.supervised = False
            assert proc.popen is not None
            proc.popen.kill()
            code = proc.popen.wait(timeout=10)
            proc.exits.append(code)
            return code

    def died(self) -> set[int]:
        """The pids of the processes started here that ended with a status other than 0."""
        with self._lock:
            return {popen.pid for popen in self._all if popen.poll() not in (None, 0)}

    def tail(self, proc: Proc, chars: int = 3000) -> str:
        try:
            return proc.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_lines(self, proc: Proc) -> list[dict[str, Any]]:
        """The process's JSON log records (other lines skipped)."""
        records = []
        for line in proc.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def count_logs(self, proc: Proc, *messages: str) -> int:
        return sum(1 for record in self.log_lines(proc) if record.get("msg") in messages)

    def write_retries(self, workers: list[Proc]) -> dict[str, int]:
        """By worker, the times it retried a result write or a step while the database was away."""
        return {
            w.name: self.count_logs(
                w, "database unavailable; retrying the result write", "dependency error; retrying"
            )
            for w in workers
        }

    def reenqueued(self, proc: Proc) -> int:
        """How many jobs the reconciler (in this Celery worker) re-enqueued."""
        return sum(
            int(record.get("count", 0))
            for record in self.log_lines(proc)
            if record.get("msg") == "re-enqueued jobs whose stream entry was lost"
        )

    def diagnostics(self, lines: int = 25) -> str:
        """Each process's exits and its last warnings, errors and non-JSON lines."""
        parts = []
        for proc in self.procs.values():
            kept = []
            for line in proc.log.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if isinstance(record, dict) and record.get("level") in ("info", "debug"):
                    continue
                kept.append(line[:600])
            parts.append(
                f"==== {proc.name} (starts {proc.starts}, exits {proc.exits}, log {proc.log})\n"
                + "\n".join(kept[-lines:])
            )
        return "\n".join(parts)

    def stop_processes(self) -> None:
        """Kill every process started here, and restart none of them."""
        self._stop.set()
        if self._supervisor.is_alive():
            self._supervisor.join(timeout=5)
        with self._lock:
            for proc in self.procs.values():
                proc.supervised = False
            for popen in self._all:
                if popen.poll() is None:
                    # Its own session (start_new_session): the group is just it.
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(popen.pid, signal.SIGKILL)
            for popen in self._all:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=10)
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None


def wait_for(
    what: str, condition: Callable[[], bool], timeout: float, poll: float = POLL_S
) -> None:
    """Poll ``condition`` until it holds; an AssertionError naming ``what`` at the deadline."""
    until = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(poll)


def sitecustomize_dir(folder: Path, repository_root: Path, module: str) -> Path:
    """``folder`` holding a sitecustomize that calls ``module``'s ``install()`` at the start of
    every Python process whose PYTHONPATH it is on (a hook the code under test never sees)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        f"sys.path.append({str(repository_root)!r})\n"
        f"from {module} import install\n\n"
        "install()\n"
    )
    return folder


def command_line(raw: bytes) -> list[str]:
    """A process's arguments from its /proc/PID/cmdline: NUL-separated as exec left them,
    or one title string (a child ``ferry up`` forked names itself ``python -m ferry ...``
    with setproctitle), split at its spaces."""
    parts = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    return parts[0].split() if len(parts) == 1 else parts


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def process_table() -> Iterator[tuple[int, int, int]]:
    """Every process on the machine: its pid, its parent's and its session's (from
    /proc/PID/stat; one that ends while it is read is left out)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after the command, which may hold ")"
            yield int(entry), int(fields[1]), int(fields[3])


def stopped_when(
    send: Callable[[int], None], look: Callable[[], list[str]], what: str, timeout_s: float = 60
) -> list[str]:
    """Stop a process (SIGSTOP, through ``send``) at a moment ``look`` finds something in it,
    and return what it found, the process still stopped (the caller kills it, or sends it
    SIGCONT later).

    Stopped first, then looked at: what a stopped process holds cannot change while the look
    takes its time, however loaded the machine (a look racing a running worker can take
    longer than its batches and never see one). Found nothing, it is let go and stopped
    again; ``what`` names the wait in the assertion at ``timeout_s``.
    """
    until = time.monotonic() + timeout_s
    while True:
        send(signal.SIGSTOP)
        found = look()
        if found:
            return found
        send(signal.SIGCONT)
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(0.02)
