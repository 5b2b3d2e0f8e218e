"""A Redis started on a port chosen free that someone takes before the server binds it.

The test and benchmark harness (``harness.services.redis_started``) and ``ferry up``'s
own Redis (``ferry.local_redis.start_redis`` without a port) both choose a free port and
hand it to ``redis-server``, which binds it only as it starts; in between any process may
take it. Both start the server again on another port, and neither takes a server that
someone else runs on the port for its own.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from ferry import local_redis
from ferry.local_redis import RedisStartError
from harness.ports import free_port
from harness.processes import wait_for
from harness.services import redis_server, redis_started, redis_with_conf, stop_all


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something listens on that is not Redis (it never answers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield int(sock.getsockname()[1])


def ports(*chosen: int) -> Callable[[], int]:
    """What ``redis_started`` draws its ports from: these, in order."""
    return iter(chosen).__next__


def test_a_port_taken_before_the_bind_is_given_up_for_the_next(
    tmp_path: Path, taken_port: int
) -> None:
    second = free_port()
    port, process = redis_started(redis_server(), tmp_path, [], port=ports(taken_port, second))
    try:
        assert port == second
        client = redis.Redis(port=port)
        assert int(client.info("server")["process_id"]) == process.pid
        client.close()
        # The first try's server saw the port taken and said so.
        assert "Address already in use" in (tmp_path / f"redis-{taken_port}" / "log").read_text()
    finally:
        stop_all([process])


def test_another_redis_on_the_port_is_not_taken_for_the_one_started(tmp_path: Path) -> None:
    theirs_port = free_port()
    theirs = redis_with_conf(redis_server(), tmp_path / "theirs", theirs_port, [])
    try:
        client = redis.Redis(port=theirs_port)
        wait_for("a Redis of someone else's", client.ping, 10, 0.05)
        client.close()
        ours = free_port()
        port, process = redis_started(redis_server(), tmp_path, [], port=ports(theirs_port, ours))
        stop_all([process])
        assert port == ours
    finally:
        stop_all([theirs])


def test_a_server_that_fails_otherwise_is_reported_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(RedisStartError, match=r"exited at start(.|\n)*no-such-directive"):
        redis_started(redis_server(), tmp_path, ["no-such-directive yes"])


def test_ferry_ups_redis_moves_to_another_port_when_its_own_is_taken(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    second = free_port()
    monkeypatch.setattr(local_redis, "free_port", ports(taken_port, second))
    process, url = local_redis.start_redis(tmp_path)
    try:
        assert url == f"redis://127.0.0.1:{second}/0"
        client = redis.Redis.from_url(url)
        assert int(client.info("server")["process_id"]) == process.pid
        client.close()
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_ferry_ups_redis_on_a_port_it_was_given_does_not_move(
    tmp_path: Path, taken_port: int
) -> None:
    with pytest.raises(SystemExit, match=r"could not listen on port \d+: it is taken"):
        local_redis.start_redis(tmp_path, taken_port)
