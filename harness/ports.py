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
Nor is it another suite's: two suites on one machine both have a ``gw0``, and
a server of one bound on a port the other's readiness check then found
answering. A block is held by a lock file (a lock each, as harness/netns.py's
subnets), the worker's own number where it is free, else the next free one.

A port comes with the nine after it unused by this allocator: a stack's GPU
workers serve /metrics on ``FERRY_METRICS_PORT_BASE`` plus their index.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import threading
from pathlib import Path
from typing import IO

from harness.locks import try_lock

BLOCKS_START = 10_000  # the kernel's ephemeral range begins at 32768 by default
BLOCK_PORTS = 2_000  # each test process's ports: 200 of them, ten apart
STRIDE = 10
MAX_WORKERS = 11  # blocks 0 .. 10 (gw0 .. gw10 where they are free): 10000 .. 31999

OWNER_ENV = "HARNESS_PORTS_OWNER"  # the pid of the process the block is for
BLOCK_ENV = "HARNESS_PORTS_BLOCK"  # the number of its block
LOCKS = Path(tempfile.gettempdir()) / "ferry-ports"

_lock = threading.Lock()
_next: dict[int, int] = {}
_held: IO[bytes] | None = None  # the lock file of this process's block, open while it lives


def claim_block(environ: dict[str, str] | None = None) -> int:
    """Make this process (a pytest-xdist worker) the one a block is for: its worker's
    number where no other process on the machine holds it, else the next free one."""
    global _held
    env = os.environ if environ is None else environ
    match = re.fullmatch(r"gw(\d+)", env.get("PYTEST_XDIST_WORKER", ""))
    own = int(match.group(1)) % MAX_WORKERS if match else 0
    LOCKS.mkdir(exist_ok=True)
    for number in [(own + i) % MAX_WORKERS for i in range(MAX_WORKERS)]:
        lock = try_lock(LOCKS / f"{number}.lock")
        if lock is None:
            continue
        if _held is not None:
            _held.close()
        _held = lock
        env[OWNER_ENV] = str(os.getpid())
        env[BLOCK_ENV] = str(number)
        return number
    raise RuntimeError(f"all {MAX_WORKERS} port blocks are held by other test processes")


def block_index(environ: dict[str, str] | None = None) -> int | None:
    """The number of the block this process claimed (``claim_block``), else None (a
    process a worker started inherits its environment, not its block)."""
    env = os.environ if environ is None else environ
    block = env.get(BLOCK_ENV, "")
    if not block.isdigit() or env.get(OWNER_ENV) != str(os.getpid()):
        return None
    return int(block) % MAX_WORKERS


def bindable(port: int) -> bool:
    """Whether a listener could bind ``port`` on 127.0.0.1 now."""
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
    index = block_index()
    if index is None:
        return kernel_port()
    start = BLOCKS_START + index * BLOCK_PORTS
    with _lock:
        for _ in range(BLOCK_PORTS // STRIDE):
            offset = _next.get(index, 0)
            _next[index] = (offset + STRIDE) % BLOCK_PORTS
            # One still held by a server of an earlier test (the block wrapped) is passed over.
            if bindable(start + offset):
                return start + offset
    raise RuntimeError(f"no free port in {start}..{start + BLOCK_PORTS - 1}")
