"""core.streams.events.append_token(s) on a real Redis: a token event lands only where it
comes next.

A worker cut off from Redis mid-step can have its token writes arrive late
(TCP sends them again once the link is back), after another worker took the
job over and streamed on, or finished it; those writes must change nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from core.streams.events import JobEvent, append_token, append_tokens, run_appends
from core.streams.protocol import events_key
from harness.ports import free_port
from harness.processes import wait_for
from harness.services import redis_server, redis_with_conf


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[redis.Redis]:
    """A client of a Redis of the test's own, whose scripts the test may flush."""
    port = free_port()
    server = redis_with_conf(redis_server(), tmp_path / "redis", port, [])
    client = redis.Redis(port=port, decode_responses=True)
    try:
        wait_for("a Redis of the test's own", client.ping, 10, 0.05)
        yield client
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def indices(client: redis.Redis, key: str) -> list[int | None]:
    entries: Any = client.xrange(key)
    return [JobEvent.decode(fields).index for _id, fields in entries]


def token(index: int) -> JobEvent:
    return JobEvent.token_event(index, 100 + index, f"t{index}")


def test_each_token_lands_once_in_order_and_a_late_one_changes_nothing(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    key = events_key(key_prefix, "tiny", "job")
    redis_client.xadd(key, JobEvent.running().encode())  # type: ignore[arg-type]
    assert [append_token(redis_client, key, token(i)) for i in (0, 1, 2)] == [1, 1, 1]
    # A late copy of a token already there, one from the future, and one from the past.
    assert [append_token(redis_client, key, token(i)) for i in (2, 4, 1)] == [0, 0, 0]
    # Taken over: the taker's running events (several takeovers) come after the tokens,
    # and it streams on from the next index.
    for _ in range(5):
        redis_client.xadd(key, JobEvent.running().encode())  # type: ignore[arg-type]
    assert append_token(redis_client, key, token(2)) == 0
    assert append_token(redis_client, key, token(3)) == 1
    redis_client.xadd(key, JobEvent.done("succeeded", "length").encode())  # type: ignore[arg-type]
    assert append_token(redis_client, key, token(4)) == 0  # nothing after the end
    assert indices(redis_client, key) == [None, 0, 1, 2, *[None] * 5, 3, None]
    events: Any = redis_client.xrange(key)
    assert JobEvent.decode(events[-2][1]) == token(3)


def test_in_a_pipeline_the_tokens_of_one_step_land_in_order(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    first, second = (events_key(key_prefix, "tiny", job) for job in ("a", "b"))
    pipe = redis_client.pipeline(transaction=False)
    for index in (0, 1, 1):
        append_token(pipe, first, token(index))
    append_token(pipe, second, token(3))  # a stream with no token yet takes only index 0
    # As the workers run theirs: this may be the shared Redis's first call of the script.
    assert run_appends(redis_client, pipe) == [1, 1, 0, 0]
    assert indices(redis_client, first) == [0, 1]
    assert redis_client.exists(second) == 0


def test_a_redis_that_forgot_the_script_still_takes_the_tokens(own_redis: redis.Redis) -> None:
    """Sent by the script's SHA: a Redis that restarted (or flushed its scripts) answers
    NOSCRIPT, and the calls are sent again whole, in order."""
    key = events_key("forgot", "tiny", "job")
    assert append_token(own_redis, key, token(0)) == 1  # alone: loaded by its first EVAL
    own_redis.script_flush()
    pipe = own_redis.pipeline(transaction=False)
    for index in (1, 2, 2):
        append_token(pipe, key, token(index))
    pipe.xlen(key)
    assert run_appends(own_redis, pipe) == [1, 1, 0, 1]  # the XLEN ran before the retries
    assert indices(own_redis, key) == [0, 1, 2]
    own_redis.script_flush()
    assert append_token(own_redis, key, token(3)) == 1


def test_a_steps_tokens_in_one_call_land_as_each_alone_would(
    redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    first, second, ended = (events_key(key_prefix, "tiny", job) for job in ("a", "b", "c"))
    redis_client.xadd(ended, JobEvent.done("cancelled", "cancelled").encode())  # type: ignore[arg-type]
    # Two of a's in order, a duplicate of the second, b's from the future, a token after c's end.
    calls = [(first, token(0)), (first, token(1)), (first, token(1)), (second, token(2)),
             (ended, token(0))]  # fmt: skip
    assert append_tokens(redis_client, calls) == [1, 1, 0, 0, 0]
    assert indices(redis_client, first) == [0, 1]
    assert redis_client.exists(second) == 0 and redis_client.xlen(ended) == 1
    events: Any = redis_client.xrange(first)
    assert [JobEvent.decode(f) for _, f in events] == [token(0), token(1)]  # fields as one's
    assert append_tokens(redis_client, []) == []
    # A token's logprob travels with it, where its job asked for one.
    logprob = {"token": 5, "text": "x", "logprob": -0.25, "top_logprobs": []}
    asked = JobEvent.token_event(2, 5, "x", logprob)
    assert append_tokens(redis_client, [(first, asked), (second, token(0))]) == [1, 1]
    events = redis_client.xrange(first)
    assert JobEvent.decode(events[-1][1]) == asked
    events = redis_client.xrange(second)
    assert JobEvent.decode(events[0][1]).logprob is None


def test_a_redis_that_forgot_the_steps_script_still_takes_its_tokens(
    own_redis: redis.Redis,
) -> None:
    key = events_key("forgot", "tiny", "job")
    pipe = own_redis.pipeline(transaction=False)
    append_tokens(pipe, [(key, token(0)), (key, token(1))])
    pipe.xlen(key)
    # Never loaded: NOSCRIPT, sent again whole after the pipeline (the XLEN ran before).
    assert run_appends(own_redis, pipe) == [[1, 1], 0]
    own_redis.script_flush()
    pipe = own_redis.pipeline(transaction=False)
    append_tokens(pipe, [(key, token(2)), (key, token(2))])
    assert run_appends(own_redis, pipe) == [[1, 0]]
    assert indices(own_redis, key) == [0, 1, 2]
