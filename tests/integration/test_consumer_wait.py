"""How the consumer waits for new entries, on a real Redis.

A Redis blocked read times out only at the server's cron tick (100 ms at the
default hz), so the scheduler's short windows must not be waits Redis times.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from core.config.settings import Settings
from core.streams.protocol import JobMessage, Scripts
from workers.gpu.consumer import PRECISE_BELOW_MS, StreamConsumer

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


class Spy(redis.Redis):
    """The real client, remembering the BLOCK of every XREADGROUP."""

    blocks: list[int | None]

    def xreadgroup(self, *args: Any, **kwargs: Any) -> Any:
        self.blocks.append(kwargs.get("block"))
        return super().xreadgroup(*args, **kwargs)


def consumer(settings: Settings) -> tuple[StreamConsumer, Spy]:
    assert settings.redis_url
    client = Spy(
        connection_pool=redis.ConnectionPool.from_url(settings.redis_url, decode_responses=True)
    )
    client.blocks = []
    reader = StreamConsumer(client, settings.key_prefix, "sim", "waiter")
    reader.ensure_groups()
    return reader, client


def test_a_short_wait_polls_instead_of_asking_redis_to_block(settings: Settings) -> None:
    reader, client = consumer(settings)
    began = time.monotonic()
    assert reader.read(8, 20) == []
    assert time.monotonic() - began >= 0.02  # it did wait the window
    assert client.blocks and all(block is None for block in client.blocks)


def test_an_entry_that_arrives_during_a_short_wait_is_returned(
    settings: Settings, redis_client: redis.Redis
) -> None:
    reader, client = consumer(settings)
    message = JobMessage(
        job_id="00000000-0000-4000-8000-000000000001", lane="normal", cost=1,
        enqueued_at_ms=int(time.time() * 1000), deadline_at_ms=None, request_id=None,
    )  # fmt: skip
    polls = 0
    get = client.get

    def enqueue_at_the_first_poll(name: Any) -> Any:
        # The job arrives once the reader is waiting (its first poll of the counter),
        # however late a loaded machine runs this thread.
        nonlocal polls
        polls += 1
        if polls == 1:
            Scripts(redis_client).enqueue(redis_client, settings.key_prefix, "sim", message)
        return get(name)

    client.get = enqueue_at_the_first_poll  # type: ignore[method-assign]
    got = reader.read(8, PRECISE_BELOW_MS - 1)
    assert polls >= 1  # it was waiting when the job came
    assert [entry.message.job_id for entry in got] == [message.job_id]
    assert all(block is None for block in client.blocks)


def test_a_long_idle_wait_blocks_in_redis(settings: Settings) -> None:
    reader, client = consumer(settings)
    assert reader.read(8, PRECISE_BELOW_MS) == []
    assert client.blocks[-1] == PRECISE_BELOW_MS


@pytest.mark.parametrize("tenant", ["", "key-1"])
def test_a_drained_stream_is_not_asked_again_until_something_is_enqueued(
    settings: Settings, redis_client: redis.Redis, tenant: str
) -> None:
    """A stream found drained costs no XREADGROUP at the next look while the model's
    enqueue sequence (a tenant's stream: its last enqueue) has not moved; one entry
    enqueued, to a tenant's stream or to a lane's shared one, is read at the next."""
    scripts = Scripts(redis_client)

    def message(n: int) -> JobMessage:
        return JobMessage(
            job_id=f"00000000-0000-4000-8000-00000000000{n}", lane="normal", cost=1,
            enqueued_at_ms=int(time.time() * 1000), deadline_at_ms=None, request_id=None,
            tenant=tenant,
        )  # fmt: skip

    scripts.enqueue(redis_client, settings.key_prefix, "sim", message(1))
    reader, client = consumer(settings)
    assert [e.message.job_id for e in reader.read(8, None)] == [message(1).job_id]
    reader.read(8, None)  # finds every stream drained
    asked = len(client.blocks)
    assert reader.read(8, None) == [] and reader.read(8, None) == []
    assert len(client.blocks) == asked  # nothing asked: nothing was enqueued
    scripts.enqueue(redis_client, settings.key_prefix, "sim", message(2))
    assert [e.message.job_id for e in reader.read(8, None)] == [message(2).job_id]
