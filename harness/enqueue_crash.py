"""An API process killed between its database commit and its enqueue, exactly there.

A ``sitecustomize`` the fault suite puts on the API's ``PYTHONPATH``
(:func:`sitecustomize_dir`) calls :func:`install`, which wraps the API's
``GroupWriter._enqueue``: the group's rows are committed when it is called,
and its stream entries not yet written. When the file :data:`ENV` names
appears, the first call to find it takes it (removes it: one thread of one
process wins), writes the ids of the jobs its group committed next to it
(:func:`committed_ids`), and kills its own process with SIGKILL before writing
a single entry. A process started after that finds no file and runs as it is.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from harness import processes

ENV = "FERRY_TEST_CRASH_BEFORE_ENQUEUE"


def install() -> None:
    """Wrap GroupWriter._enqueue to die in it once the trigger file appears."""
    trigger = os.environ.get(ENV)
    if not trigger:
        return
    from api.jobs.submissions import GroupWriter

    original = GroupWriter._enqueue

    def _enqueue(self: GroupWriter, group: Any, jobs: dict[int, Any], *args: Any) -> Any:
        try:
            os.unlink(trigger)
        except FileNotFoundError:
            return original(self, group, jobs, *args)
        ids = json.dumps([job.id for job in jobs.values()]).encode()
        fd = os.open(_ids_path(trigger), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, ids)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL cannot be caught")

    setattr(GroupWriter, "_enqueue", _enqueue)  # noqa: B010 (a wrapper of another signature)


def _ids_path(trigger: str | Path) -> Path:
    return Path(f"{trigger}.committed")


def committed_ids(trigger: Path) -> list[str] | None:
    """The jobs the killed process had committed and not enqueued (None: not killed yet)."""
    path = _ids_path(trigger)
    if not path.exists():
        return None
    ids: list[str] = json.loads(path.read_text())
    return ids


def sitecustomize_dir(root: Path, repository_root: Path) -> Path:
    """A folder holding a sitecustomize that installs the crash; put it on PYTHONPATH."""
    return processes.sitecustomize_dir(
        root / "enqueue-crash-site", repository_root, "harness.enqueue_crash"
    )
