"""Lock files that say which process on this machine holds a shared resource.

A test resource that several test processes could take at once (a port block,
a subnet) is each process's while it holds the resource's lock file: an
exclusive ``flock``, let go when the file is closed or its process ends,
however it ends.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO


def try_lock(path: Path) -> IO[bytes] | None:
    """The open lock file at ``path``, held by this process, or None where another holds it."""
    lock = path.open("ab")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock
