"""The Redis that `ferry up` starts on a machine that has none."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from ferry import local_redis
from ferry.local_redis import find_redis_server, start_redis


def test_without_redis_on_path_the_bundled_server_is_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(local_redis.shutil, "which", lambda _name: None)
    server = find_redis_server()
    assert Path(server).name == "redis-server" and Path(server).exists()
    process, url = start_redis(tmp_path)
    try:
        client = redis.Redis.from_url(url, decode_responses=True)
        # Durable as docs/architecture.md §4 requires: AOF, fsync every second, never evict.
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert Path(str(client.config_get("dir")["dir"])) == (tmp_path / "redis").resolve()
        client.xadd("probe", {"a": "1"})
        client.close()
    finally:
        process.terminate()
        process.wait(timeout=10)
    # What was written survives a restart (the append-only file is replayed).
    process, url = start_redis(tmp_path)
    try:
        client = redis.Redis.from_url(url, decode_responses=True)
        assert client.xlen("probe") == 1
        client.close()
    finally:
        process.terminate()
        process.wait(timeout=10)
