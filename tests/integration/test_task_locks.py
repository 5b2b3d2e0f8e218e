"""workers.tasks.locks on a real Redis: only the holder of a lock renews or releases it; one
call gets through a gate per interval."""

from __future__ import annotations

import redis

from harness.ports import free_port
from harness.processes import wait_for
from workers.tasks.locks import first_in, release, renew


def test_only_the_token_that_holds_a_lock_renews_or_releases_it(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    lock = f"{key_prefix}:a-lock"
    assert redis_client.set(lock, "mine", nx=True, px=500)
    assert not renew(redis_client, lock, "theirs", 60_000)
    assert 0 < redis_client.pttl(lock) <= 500  # untouched by another's renewal
    assert renew(redis_client, lock, "mine", 60_000)
    assert redis_client.pttl(lock) > 500
    assert not release(redis_client, lock, "theirs")
    assert redis_client.exists(lock) == 1
    assert release(redis_client, lock, "mine")
    assert redis_client.exists(lock) == 0
    # Expired and taken by another run: the first holder's calls change nothing.
    redis_client.set(lock, "next")
    assert not renew(redis_client, lock, "mine", 60_000)
    assert not release(redis_client, lock, "mine")
    assert redis_client.get(lock) in ("next", b"next")


def test_one_call_gets_in_per_interval_and_an_unreachable_redis_lets_it_in(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    gate = f"{key_prefix}:a-gate"
    assert first_in(redis_client, gate, 300)
    assert not first_in(redis_client, gate, 300)  # a tick that waited in the queue
    wait_for("the interval to pass", lambda: redis_client.exists(gate) == 0, 5, 0.02)
    assert first_in(redis_client, gate, 300)
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    assert first_in(unreachable, gate, 300)
