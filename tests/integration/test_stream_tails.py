"""api.jobs.tails on a real Redis: every reader of every job's events stream gets each
entry once, in order, from where it started, while the process holds one blocked
connection per model; a reader that joins a blocked read is read at once; a lost
Redis ends each reader's wait with the error."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from api.jobs import tails as tails_module
from api.jobs.tails import StreamTails, Tail
from core.streams.protocol import events_key
from core.streams.target import RedisTarget
from harness.ports import free_port
from harness.processes import wait_for
from harness.services import redis_server, redis_with_conf


async def _collect(tail: Tail, count: int, seconds: float) -> list[str]:
    """The values of the next ``count`` entries handed to ``tail``."""
    got: list[str] = []
    deadline = asyncio.get_running_loop().time() + seconds
    while len(got) < count and asyncio.get_running_loop().time() < deadline:
        got += [str(fields["n"]) for _id, fields in await tail.next(200)]
    return got


def _events_connections(client: redis.Redis, prefix: str) -> int:
    return sum(1 for c in client.client_list() if c.get("name", "").startswith(f"{prefix}-events-"))


def test_every_reader_gets_its_entries_once_in_order_on_one_connection_a_model(
    redis_url: str, key_prefix: str, redis_client: redis.Redis
) -> None:
    models = ("tiny", "small")
    jobs = [(models[i % 2], f"job-{i}") for i in range(24)]
    keys = {job: events_key(key_prefix, model, job) for model, job in jobs}
    # Every other stream holds three entries before its reader comes; every fourth's reader
    # starts after the second of them (a client resuming with Last-Event-ID).
    ids: dict[str, list[str]] = {job: [] for _model, job in jobs}
    first: dict[str, int] = {}  # the first entry each reader must get
    for i, (_model, job) in enumerate(jobs):
        if i % 2 == 0:
            ids[job] = [str(redis_client.xadd(keys[job], {"n": str(n)})) for n in range(3)]
        first[job] = 2 if i % 4 == 0 else 0 if i % 2 == 0 else 3
    last = 23  # the entries 3 to 22 come while they read

    async def scenario() -> None:
        tails = StreamTails(RedisTarget(url=redis_url), key_prefix)
        try:
            with contextlib.ExitStack() as scope:
                readers = {
                    job: scope.enter_context(
                        tails.tail(model, keys[job], ids[job][1] if first[job] == 2 else "0-0")
                    )
                    for model, job in jobs
                }
                # The same stream twice, from two places.
                twin = scope.enter_context(tails.tail("tiny", keys["job-2"], ids["job-2"][0]))

                async def write() -> None:
                    for n in range(3, last):
                        for _model, job in random.sample(jobs, len(jobs)):
                            await asyncio.to_thread(redis_client.xadd, keys[job], {"n": str(n)})
                        await asyncio.sleep(0.01)

                writing = asyncio.create_task(write())
                got = await asyncio.gather(
                    *(_collect(readers[job], last - first[job], 30) for _m, job in jobs)
                )
                await writing
                for (_model, job), values in zip(jobs, got, strict=True):
                    assert values == [str(n) for n in range(first[job], last)], job
                assert await _collect(twin, last - 1, 30) == [str(n) for n in range(1, last)]
                assert _events_connections(redis_client, key_prefix) == len(models)
        finally:
            await tails.stop()
        # Closed at the stop (the server notices within moments).
        for _ in range(100):
            if _events_connections(redis_client, key_prefix) == 0:
                break
            await asyncio.sleep(0.05)
        assert _events_connections(redis_client, key_prefix) == 0

    asyncio.run(scenario())


def test_a_reader_that_joins_a_blocked_read_is_read_at_once(
    redis_url: str, key_prefix: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A block far longer than the wait below: only the unblocking can meet it.
    monkeypatch.setattr(tails_module, "BLOCK_MS", 60_000)
    first, second = (events_key(key_prefix, "tiny", job) for job in ("a", "b"))
    redis_client.xadd(second, {"n": "0"})

    async def scenario() -> None:
        tails = StreamTails(RedisTarget(url=redis_url), key_prefix)
        try:
            with tails.tail("tiny", first, "0-0") as waiting:
                assert await waiting.next(300) == []  # its XREAD is blocked by now
                with tails.tail("tiny", second, "0-0") as joining:
                    assert await _collect(joining, 1, 10) == ["0"]
                await asyncio.to_thread(redis_client.xadd, first, {"n": "1"})
                assert await _collect(waiting, 1, 10) == ["1"]
        finally:
            await tails.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.fixture
def own_redis_url(tmp_path: Path) -> Iterator[tuple[str, object]]:
    port = free_port()
    server = redis_with_conf(redis_server(), tmp_path / "redis", port, [])
    client = redis.Redis(port=port)
    try:
        wait_for("a Redis of the test's own", client.ping, 10, 0.05)
        yield f"redis://127.0.0.1:{port}/0", server
    finally:
        client.close()
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=10)


def test_a_lost_redis_ends_each_readers_wait_with_the_error(
    own_redis_url: tuple[str, object],
) -> None:
    url, server = own_redis_url

    async def scenario() -> None:
        tails = StreamTails(RedisTarget(url=url), "p")
        try:
            with (
                tails.tail("tiny", "p:{tiny}:events:a", "0-0") as one,
                tails.tail("tiny", "p:{tiny}:events:b", "0-0") as two,
            ):
                assert await one.next(300) == []
                server.kill()  # type: ignore[attr-defined]
                for tail in (one, two):
                    with pytest.raises(redis.exceptions.ConnectionError):
                        for _ in range(50):
                            await tail.next(200)
        finally:
            await tails.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_on_a_cluster_each_models_streams_are_read_together(tmp_path: Path) -> None:
    """On a Redis Cluster a model's streams share its slot (the ``{model}`` hash tag), so
    one XREAD names them all (its wake stream too), on the node that serves it."""
    from harness.cluster import ClusterRedis

    with ClusterRedis(tmp_path / "cluster") as cluster:
        models = [f"m{n}" for n in range(6)]  # spread over the primaries
        assert len({cluster.owner(events_key("p", model, "x")) for model in models}) > 1
        keys = {(model, n): events_key("p", model, f"job-{n}") for model in models for n in (0, 1)}
        nodes = {key: cluster.node(cluster.owner(key)) for key in keys.values()}

        async def scenario() -> None:
            tails = StreamTails(RedisTarget(url=cluster.url, cluster=True), "p")
            try:
                with contextlib.ExitStack() as scope:
                    readers = {
                        key: scope.enter_context(tails.tail(model, key, "0-0"))
                        for (model, _n), key in keys.items()
                    }
                    for n in range(5):
                        for key in keys.values():
                            await asyncio.to_thread(nodes[key].xadd, key, {"n": str(n)})
                    for key, tail in readers.items():
                        assert await _collect(tail, 5, 10) == [str(n) for n in range(5)], key
            finally:
                await tails.stop()

        asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_reader_that_joins_a_followed_stream_from_further_back_misses_nothing(
    redis_url: str, key_prefix: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second reader of a stream, from its start, while the first follows its end and
    entries keep coming: the reads that answer the first reader's place are not handed
    to it (it would skip what lies between); the next read, from its place, is."""
    # No wake: the joining reader is named only once the XREAD in flight returns, which
    # the entries coming make it do with the first reader's place.
    monkeypatch.setattr(StreamTails, "_wake", lambda self, reader: None)
    key = events_key(key_prefix, "tiny", "followed")
    for n in range(5):
        redis_client.xadd(key, {"n": str(n)})

    async def scenario() -> None:
        tails = StreamTails(RedisTarget(url=redis_url), key_prefix)
        try:
            with tails.tail("tiny", key, "0-0") as first:
                assert await _collect(first, 5, 10) == [str(n) for n in range(5)]

                async def write() -> None:
                    for n in range(5, 40):
                        await asyncio.to_thread(redis_client.xadd, key, {"n": str(n)})
                        await asyncio.sleep(0.005)

                writing = asyncio.create_task(write())
                await asyncio.sleep(0.02)
                with tails.tail("tiny", key, "0-0") as second:
                    got = await _collect(second, 40, 20)
                await writing
                assert got == [str(n) for n in range(40)]
                assert await _collect(first, 35, 10) == [str(n) for n in range(5, 40)]
        finally:
            await tails.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_what_came_before_an_error_is_returned_first() -> None:
    async def scenario() -> None:
        tail = Tail("k", "0-0")
        tail._hand([("1-0", {"n": "0"}), ("2-0", {"n": "1"})])
        tail._fail(redis.exceptions.ConnectionError("gone"))
        assert [fields["n"] for _id, fields in await tail.next(100)] == ["0", "1"]
        with pytest.raises(redis.exceptions.ConnectionError, match="gone"):
            await tail.next(100)
        with pytest.raises(redis.exceptions.ConnectionError):
            await tail.next(100)

    asyncio.run(scenario())
