"""The execution record: every batch a worker computed, appended before its outcomes are written.

Off unless ``FERRY_EXECUTION_LOG_DIR`` is set (the fault suite and the soak set
it). Each worker process then appends one JSON line per batch the device
lands to a file of its own, ``<worker>.<pid>.jsonl``: the worker's name, its
pid, the batch's number in this process, and each job computed with its
attempt. The line is written before the batch is handed over to be recorded,
so it does not depend on the conditional terminal write: a job computed twice
appears twice even when the second result was refused.

A plain file, not Redis or the database, so that it outlives each fault the
suite injects: Redis restarted empty, the database unreachable, and kill -9
(a line is the kernel's once ``write`` returns; nothing is fsynced, so a
machine that loses power may lose the last lines, which no test does). One
file per process and one ``write`` per line, opened with ``O_APPEND``: no two
writers share a file, and a process killed mid-line leaves at most a last line
without its newline, which :func:`read_executions` skips (that batch's outcomes
were not written either).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Execution:
    """One batch as the record has it: who computed which jobs, at which attempts."""

    worker: str
    pid: int
    seq: int  # the batch's number among the ones this process landed, from 1
    batch_id: str
    jobs: tuple[tuple[str, int], ...]  # (job id, attempt)


class ExecutionLog:
    """Appends the batches this process computes to ``directory/<worker>.<pid>.jsonl``."""

    def __init__(self, directory: Path, worker: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.worker = worker
        self.pid = os.getpid()
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", worker)
        self.path = directory / f"{safe}.{self.pid}.jsonl"
        self._fd = -1  # opened at the first batch, and again after close()
        self._seq = 0

    def append(self, batch_id: str, jobs: Sequence[tuple[str, int]]) -> None:
        """Record a computed batch; returns once the line is the kernel's."""
        self._seq += 1
        line = json.dumps(
            {
                "worker": self.worker,
                "pid": self.pid,
                "seq": self._seq,
                "batch": batch_id,
                "jobs": [[job_id, attempt] for job_id, attempt in jobs],
            },
            separators=(",", ":"),
        )
        data = (line + "\n").encode()
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        while data:
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_executions(directory: Path) -> list[Execution]:
    """Every batch recorded under ``directory``, file by file, each in the order written."""
    return [e for path in sorted(directory.glob("*.jsonl")) for e in _read(path)]


def _read(path: Path) -> Iterator[Execution]:
    text = path.read_text()
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            return  # cut short by a kill: the batch's outcomes were not written after it
        record = json.loads(line)
        yield Execution(
            worker=record["worker"],
            pid=int(record["pid"]),
            seq=int(record["seq"]),
            batch_id=record["batch"],
            jobs=tuple((str(job_id), int(attempt)) for job_id, attempt in record["jobs"]),
        )
