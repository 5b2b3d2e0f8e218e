"""Every live reader of this API process's job events on one blocked XREAD per model.

A client following a generation (``GET /v1/jobs/{id}/events``, an OpenAI route with
``stream: true``) waits for its job's next events. A blocked XREAD holds its Redis
connection for as long as it waits, so one per reader would cost a connection for
every stream open on every API process (a request for 16 choices of 4 prompts, 64),
up to Redis's limit on clients. :class:`StreamTails` holds one instead for all the
readers of one model's jobs (their events streams share the model's hash tag, so
one XREAD may name them all, on a Redis Cluster too): each reader's stream with the
id of the last entry handed to it, the entries that come handed to the readers of
each stream, each reader's own from where it is.

A reader that joins while the XREAD is blocked is read at once: the blocked
connection is unblocked (``CLIENT UNBLOCK``, Redis 5 and later) and the XREAD sent
again with its stream. A Redis Cluster routes no such command to the node that holds
the blocked connection, so there the XREAD blocks at most :data:`CLUSTER_BLOCK_MS`
at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis.asyncio as aioredis

from api.background import close_client, stop_task
from core.streams.target import RedisTarget

log = logging.getLogger(__name__)

Entry = tuple[str, Mapping[bytes | str, bytes | str]]

# One XREAD blocks at most this long (then it is sent again): its connection's timeout
# is set past it.
BLOCK_MS = 2000
# On a Redis Cluster, where no CLIENT UNBLOCK reaches the blocked connection, a reader
# that joins waits at most this long for its first read.
CLUSTER_BLOCK_MS = 50
READ_COUNT = 256
# A reader that joins unblocks the XREAD: tried this often, this many times (its XREAD
# may not be blocking yet).
UNBLOCK_EVERY_S = 0.002
UNBLOCK_TRIES = 50


def _order(entry_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


@dataclass(eq=False)
class Tail:
    """One reader's place in one stream: the entries handed to it, in order, as they come."""

    key: str
    delivered: str  # the last entry id handed to this reader (or the one it starts after)
    _queue: asyncio.Queue[list[Entry] | BaseException] = field(
        default_factory=asyncio.Queue, repr=False
    )

    def _hand(self, entries: list[Entry]) -> None:
        after = _order(self.delivered)
        new = [entry for entry in entries if _order(str(entry[0])) > after]
        if new:
            self.delivered = str(new[-1][0])
            self._queue.put_nowait(new)

    async def next(self, wait_ms: int | None) -> list[Entry]:
        """The entries come since the last call, waiting up to ``wait_ms`` for some (none:
        do not wait); [] if none came. Raises what the read raised (Redis unreachable)."""
        if self._queue.empty() and wait_ms:
            with anyio.move_on_after(wait_ms / 1000.0):
                self._queue.put_nowait(await self._queue.get())
        entries: list[Entry] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                raise item
            entries += item
        return entries


@dataclass(eq=False)
class _Reader:
    """The blocked XREAD of one model's streams: its connection, its readers."""

    client: aioredis.Redis
    tails: dict[str, set[Tail]] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    connection_id: int | None = None  # its connection's, while it blocks
    blocked: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class StreamTails:
    """The process's readers of job events streams, one blocked XREAD per model."""

    def __init__(self, target: RedisTarget, prefix: str) -> None:
        self.target = target
        self.prefix = prefix
        self.cluster = target.cluster
        # Reads that do not wait (a finished job's last entries, whether its stream is
        # there) and the unblocking of a reader's XREAD: pooled connections, none held.
        self.client: aioredis.Redis = target.async_client(
            decode_responses=True, socket_timeout=5, socket_connect_timeout=2
        )
        self._readers: dict[str, _Reader] = {}
        self._wakes: set[asyncio.Task[None]] = set()
        self._stopped = False

    @contextlib.contextmanager
    def tail(self, model: str, key: str, after: str) -> Iterator[Tail]:
        """A reader of stream ``key`` (a job of ``model``) from after entry ``after``, for
        the block's length."""
        if self._stopped:
            raise RuntimeError("the API is stopping")
        tail = Tail(key, after)
        reader = self._readers.get(model)
        if reader is None:
            reader = self._readers[model] = _Reader(self._blocking_client(model))
        reader.tails.setdefault(key, set()).add(tail)
        if reader.task is None or reader.task.done():
            reader.task = asyncio.create_task(self._read(model, reader), name=f"tails-{model}")
        else:
            self._wake(reader)
        try:
            yield tail
        finally:
            held = reader.tails.get(key)
            if held is not None:
                held.discard(tail)
                if not held:
                    del reader.tails[key]
            # The XREAD may still name its stream until it returns (what comes for it then
            # is dropped); the last reader of the model's streams ends it at once.
            if not reader.tails and not self._stopped:
                self._wake(reader)

    def _blocking_client(self, model: str) -> aioredis.Redis:
        return self.target.async_client(
            decode_responses=True,
            socket_timeout=BLOCK_MS / 1000.0 + 5.0,
            socket_connect_timeout=2,
            # Named for an operator's CLIENT LIST: the deployment (its key prefix) and
            # the model.
            client_name=f"{self.prefix}-events-{model}",
        )

    def _wake(self, reader: _Reader) -> None:
        """Have ``reader``'s XREAD sent again with the streams it has now."""
        reader.changed.set()
        if self.cluster:
            return  # its XREAD blocks CLUSTER_BLOCK_MS at most
        task = asyncio.create_task(self._unblock(reader))
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def _unblock(self, reader: _Reader) -> None:
        # Until the reader has taken the change: an UNBLOCK sent before its XREAD blocks
        # unblocks nothing, and the XREAD would wait out its block with the old streams.
        # A wake that never lands (the reader's connection replaced meanwhile) costs one
        # block at most.
        with contextlib.suppress(Exception):
            for _ in range(UNBLOCK_TRIES):
                if not reader.changed.is_set() or self._stopped:
                    return
                if (
                    reader.blocked
                    and reader.connection_id is not None
                    and await self.client.client_unblock(reader.connection_id)
                ):
                    return
                await asyncio.sleep(UNBLOCK_EVERY_S)
            reader.connection_id = None  # asked again before the next XREAD

    async def _read(self, model: str, reader: _Reader) -> None:
        client = reader.client
        block_ms = CLUSTER_BLOCK_MS if self.cluster else BLOCK_MS
        while reader.tails and not self._stopped:
            reader.changed.clear()
            streams: dict[Any, Any] = {
                key: min((tail.delivered for tail in tails), key=_order)
                for key, tails in reader.tails.items()
            }
            try:
                # The XREAD goes on the connection whose id this is: the client's pool
                # holds one, as it sends one command at a time.
                if not self.cluster and reader.connection_id is None:
                    reader.connection_id = int(await client.client_id())
                reader.blocked = True
                try:
                    found: Any = await client.xread(streams, count=READ_COUNT, block=block_ms)
                finally:
                    reader.blocked = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Redis unreachable (restarted, failed over): each reader's stream ends with
                # the error, as it would have on a connection of its own; a reader that
                # comes later is read on a new connection.
                log.warning(
                    "job events read failed", extra={"model": model, "error": type(exc).__name__}
                )
                for tails in reader.tails.values():
                    for tail in tails:
                        tail._queue.put_nowait(exc)
                reader.tails.clear()
                reader.connection_id = None
                continue
            for key, entries in _by_key(found):
                for tail in list(reader.tails.get(key, ())):
                    tail._hand(entries)

    async def stop(self) -> None:
        """Stop every read (the API is stopping) and close the connections."""
        self._stopped = True
        for task in list(self._wakes):
            task.cancel()
        for reader in list(self._readers.values()):
            await stop_task(reader.task)
            await close_client(reader.client)
        self._readers.clear()
        await close_client(self.client)


def _by_key(found: Any) -> list[tuple[str, list[Entry]]]:
    """An XREAD reply's entries by stream (RESP2's list or RESP3's map)."""
    if not found:
        return []
    if isinstance(found, dict):
        return [(str(key), list(value[0])) for key, value in found.items()]
    return [(str(key), list(entries)) for key, entries in found]
