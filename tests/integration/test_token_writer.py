"""workers.gpu.checkpoint.TokenWriter on a real Redis: when a generation's tokens are written.

The writer holds a step's tokens and writes them when due: every step with
the defaults, once a stream has ``every_tokens`` of them, ``every_ms`` after
the last write, and at once when asked (a job's first token, or before a
done event). Pipelined, the write runs on a thread while the loop goes on,
and what it raised is raised at the next write or wait.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from core.streams.events import JobEvent
from core.streams.protocol import events_key
from harness.ports import free_port
from harness.processes import wait_for
from harness.services import redis_server, redis_with_conf
from workers.gpu.checkpoint import TokenWriter


def token(index: int) -> JobEvent:
    return JobEvent.token_event(index, 100 + index, f"t{index}")


def streamed(client: redis.Redis, key: str) -> list[int | None]:
    entries: Any = client.xrange(key)
    return [JobEvent.decode(fields).index for _id, fields in entries]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("pipelined", [False, True], ids=["in-loop", "pipelined"])
def test_by_default_every_steps_tokens_are_written_in_that_step(
    redis_client: redis.Redis, key_prefix: str, pipelined: bool
) -> None:
    writer = TokenWriter(redis_client, pipelined=pipelined)
    key = events_key(key_prefix, "tiny", "job")
    try:
        for index in range(3):
            writer.add(key, token(index))
            writer.step()
            writer.wait()
            assert streamed(redis_client, key) == list(range(index + 1))
        assert writer.writes == 3
    finally:
        writer.close()


def test_tokens_wait_for_a_streams_count_or_the_interval_or_a_first_token(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    clock = Clock()
    writer = TokenWriter(redis_client, every_tokens=3, every_ms=50.0, clock=clock)
    a, b = (events_key(key_prefix, "tiny", job) for job in ("a", "b"))
    writer.add(a, token(0))
    writer.step(urgent=True)  # a's first token: written at once
    assert streamed(redis_client, a) == [0]
    writer.add(a, token(1))
    writer.add(b, token(0))
    writer.step()
    writer.add(a, token(2))
    writer.step()
    assert streamed(redis_client, a) == [0] and writer.unwritten == 3  # two of a's, one of b's
    writer.add(a, token(3))
    writer.step()  # a has three not written: all of what is held goes, b's too
    assert streamed(redis_client, a) == [0, 1, 2, 3] and streamed(redis_client, b) == [0]
    writer.add(b, token(1))
    clock.now += 0.049
    writer.step()
    assert streamed(redis_client, b) == [0]
    clock.now += 0.002  # 51 ms after the last write
    writer.step()
    assert streamed(redis_client, b) == [0, 1] and writer.writes == 3


def test_an_expiry_is_set_with_the_next_write_after_the_tokens(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    writer = TokenWriter(redis_client, every_tokens=10, every_ms=1e9)
    key = events_key(key_prefix, "tiny", "job")
    writer.add(key, token(0))
    writer.expire(key, 300)
    writer.step()
    assert redis_client.exists(key) == 0  # not due yet
    writer.write()
    assert streamed(redis_client, key) == [0]
    assert 0 < redis_client.ttl(key) <= 300  # set on the stream the tokens made


def test_what_is_discarded_is_never_written(redis_client: redis.Redis, key_prefix: str) -> None:
    writer = TokenWriter(redis_client, every_tokens=5)
    key = events_key(key_prefix, "tiny", "job")
    writer.add(key, token(0))
    writer.discard()
    writer.write()
    assert redis_client.exists(key) == 0 and writer.writes == 0


def test_a_pipelined_write_that_failed_is_raised_at_the_next(tmp_path: Path) -> None:
    port = free_port()
    server = redis_with_conf(redis_server(), tmp_path / "redis", port, [])
    client = redis.Redis(port=port, socket_timeout=2)
    writer = TokenWriter(client, pipelined=True)
    key = events_key("gone", "tiny", "job")
    try:
        wait_for("a Redis of the test's own", client.ping, 10, 0.05)
        writer.add(key, token(0))
        writer.write()
        writer.wait()
        server.terminate()
        server.wait(timeout=10)
        writer.add(key, token(1))
        writer.write()  # handed over: the loop goes on
        assert writer.in_flight is not None
        wait_for("the write to fail", writer.done, 10, 0.01)
        writer.add(key, token(2))
        with pytest.raises(redis.ConnectionError):
            writer.write()  # the last one's failure, heard of before the next is handed over
    finally:
        writer.close()
        client.close()
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=10)
