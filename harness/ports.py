"""Loopback ports for the servers tests and benchmarks start: free, and nobody else's.

A port the kernel hands out (bind to port 0) and that is then closed is free
only until the next bind to port 0 anywhere on the machine, which may get it
back before the server it was meant for binds it. Within one process that
never happens twice in a row, but several test processes at once
(``pytest -n``, pytest-xdist) hand out ephemeral ports to each other. So a
test process that pytest-xdist started (``PYTEST_XDIST_WORKER=gw<N>``) takes
its ports from a block of its own below the kernel's ephemeral range, which
the kernel never hands out and no other test process takes from; elsewhere
(a plain pytest run, a benchmark), the kernel's ephemeral port, as before.
The block is the worker process's alone (``claim_block``, tests/conftest.py):
a process it starts (a benchmark of the smoke run) inherits its
PYTEST_XDIST_WORKER, and would hand out the same ports again from the start.

A port comes with the nine after it unused by this allocator: a stack's GPU
workers serve /metrics on ``FERRY_METRICS_PORT_BASE`` plus their index.
"""

from __future__ import annotations

import os
import re
import socket
import threading

BLOCKS_START = 10_000  # the kernel's ephemeral range begins at 32768 by default
BLOCK_PORTS = 2_000  # each test process's ports: 200 of them, ten apart
STRIDE = 10
MAX_WORKERS = 11  # gw0 .. gw10: 10000 .. 31999

OWNER_ENV = "HARNESS_PORTS_OWNER"  # the pid of the process the block is for

_lock = threading.Lock()
_next: dict[int, int] = {}


def claim_block() -> None:
    """Make this process (a pytest-xdist worker) the one its worker's block is for."""
    os.environ[OWNER_ENV] = str(os.getpid())


def worker_index(environ: dict[str, str] | None = None) -> int | None:
    """The pytest-xdist worker's number (``gw3`` is 3) where this process claimed its
    block, else None."""
    env = os.environ if environ is None else environ
    match = re.fullmatch(r"gw(\d+)", env.get("PYTEST_XDIST_WORKER", ""))
    if match is None or env.get(OWNER_ENV) != str(os.getpid()):
        return None
    return int(match.group(1)) % MAX_WORKERS


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def kernel_port() -> int:
    """A port the kernel picks from its ephemeral range, closed again at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port() -> int:
    """A loopback port nothing listens on now, and no other test process is handed."""
    index = worker_index()
    if index is None:
        return kernel_port()
    start = BLOCKS_START + index * BLOCK_PORTS
    with _lock:
        for _ in range(BLOCK_PORTS // STRIDE):
            offset = _next.get(index, 0)
            _next[index] = (offset + STRIDE) % BLOCK_PORTS
            # One still held by a server of an earlier test (the block wrapped) is passed over.
            if _bindable(start + offset):
                return start + offset
    raise RuntimeError(f"no free port in {start}..{start + BLOCK_PORTS - 1}")
