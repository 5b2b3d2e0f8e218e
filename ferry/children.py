"""The processes a Ferry supervisor starts (``ferry up``, ``ferry api`` with several
processes): stopped by the kernel when the supervisor dies, however it dies.

A supervisor stops its children in order on SIGTERM or Ctrl-C; one that is killed
(SIGKILL, the OOM killer) or crashes cannot. Without this its children would run on
with no one to stop them: the API still bound to its port, the workers and Celery
retrying a Redis that went with it, each spinning on its reconnects.
"""

from __future__ import annotations

import ctypes
import signal
from typing import Any

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
