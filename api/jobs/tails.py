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

A reader that joins while the XREAD is blocked is read at once: the XREAD also
names a wake stream of this process's for the model (same hash tag), and a join
adds an entry to it, so the XREAD returns and is sent again with the new stream. A
join can never be missed (the entry waits in the wake stream for the next XREAD if
none is blocked), and it needs no administrative command and no connection id, on a
Redis Cluster as on one server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis.asyncio as aioredis

from api.background import close_client, stop_task
from core.streams.protocol import events_wake_key
from core.streams.target import RedisTarget

log = logging.getLogger(__name__)

Entry = tuple[str, Mapping[bytes | str, bytes | str]]

# One XREAD blocks at most this long (then it is sent again): its connection's timeout
# is set past it.
BLOCK_MS = 2000
READ_COUNT = 256
# A wake stream outlives a process that dies without deleting it by at most this long.
WAKE_TTL_S = 24 * 3600


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
    _error: BaseException | None = field(default=None, repr=False)

    def _hand(self, entries: list[Entry]) -> None:
        after = _order(self.delivered)
        new = [entry for entry in entries if _order(str(entry[0])) > after]
        if new:
            self.delivered = str(new[-1][0])
            self._queue.put_nowait(new)

    async def next(self, wait_ms: int | None) -> list[Entry]:
        """The entries come since the last call, waiting up to ``wait_ms`` for some (none:
        do not wait); [] if none came. Raises what the read raised (Redis unreachable),
        once the entries handed before it have been returned."""
        if self._error is not None:
            raise self._error
        if self._queue.empty() and wait_ms:
            with anyio.move_on_after(wait_ms / 1000.0):
                self._queue.put_nowait(await self._queue.get())
        entries: list[Entry] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                if not entries:
                    raise item
                self._error = item  # after what came before it
                break
            entries += item
        return entries

    def _fail(self, exc: BaseException) -> None:
        # Each reader its own error (one object raised in many tasks would gather every
        # task's traceback).
        try:
            error = type(exc)(str(exc))
            error.__cause__ = exc
        except Exception:  # a type built otherwise: the one object, then
            error = exc
        self._queue.put_nowait(error)


@dataclass(eq=False)
class _Reader:
    """The blocked XREAD of one model's streams: its connection, its readers, its wake
    stream."""

    client: aioredis.Redis
    wake_key: str
    tails: dict[str, set[Tail]] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    wake_last: str = "0-0"  # the wake stream's last entry read
    # A wake sent and not yet taken by the reader (its next XREAD names every stream
    # added before it): a burst of joins sends one.
    waking: bool = False


class StreamTails:
    """The process's readers of job events streams, one blocked XREAD per model."""

    def __init__(self, target: RedisTarget, prefix: str) -> None:
        self.target = target
        self.prefix = prefix
        # Reads that do not wait (a finished job's last entries, whether its stream is
        # there) and the wakes: pooled connections, none held.
        self.client: aioredis.Redis = target.async_client(
            decode_responses=True, socket_timeout=5, socket_connect_timeout=2
        )
        self._readers: dict[str, _Reader] = {}
        self._wakes: set[asyncio.Task[None]] = set()
        self._stopped = False
        self._process = uuid.uuid4().hex  # names this process's wake streams

    @contextlib.contextmanager
    def tail(self, model: str, key: str, after: str) -> Iterator[Tail]:
        """A reader of stream ``key`` (a job of ``model``) from after entry ``after``, for
        the block's length."""
        if self._stopped:
            raise RuntimeError("the API is stopping")
        tail = Tail(key, after)
        reader = self._readers.get(model)
        if reader is None:
            reader = self._readers[model] = _Reader(
                self._blocking_client(model), events_wake_key(self.prefix, model, self._process)
            )
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

    async def read_now(self, key: str, after: str) -> list[Entry]:
        """Stream ``key``'s entries after ``after``, without waiting (a finished job's: all
        it will hold), READ_COUNT at most."""
        found: Any = await self.client.xread({key: after}, count=READ_COUNT)
        return [entry for _key, entries in _by_key(found) for entry in entries]

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
        """Have ``reader``'s XREAD sent again with the streams it has now: an entry in its
        wake stream, which the XREAD names (one for a burst of joins)."""
        if reader.waking or reader.task is None or reader.task.done():
            return
        reader.waking = True
        task = asyncio.create_task(self._send_wake(reader))
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def _send_wake(self, reader: _Reader) -> None:
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xadd(reader.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.expire(reader.wake_key, WAKE_TTL_S)
                await pipe.execute()
        except Exception as exc:
            # Unsent: the joining reader is read when the XREAD's block ends (BLOCK_MS).
            reader.waking = False
            log.warning("job events wake failed", extra={"error": type(exc).__name__})

    async def _read(self, model: str, reader: _Reader) -> None:
        client = reader.client
        while reader.tails and not self._stopped:
            # Taken: a join from here on sends a wake of its own.
            reader.waking = False
            streams: dict[Any, Any] = {
                key: min((tail.delivered for tail in tails), key=_order)
                for key, tails in reader.tails.items()
            }
            streams[reader.wake_key] = reader.wake_last
            try:
                found: Any = await client.xread(streams, count=READ_COUNT, block=BLOCK_MS)
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
                        tail._fail(exc)
                reader.tails.clear()
                with contextlib.suppress(Exception):
                    await client.connection_pool.disconnect()
                continue
            for key, entries in _by_key(found):
                if key == reader.wake_key:
                    reader.wake_last = str(entries[-1][0])
                    continue
                # Only to the readers this XREAD read for: one that joined since, from
                # further back, would take entries past what it has not been handed yet.
                start = _order(streams[key]) if key in streams else None
                for tail in list(reader.tails.get(key, ())):
                    if start is not None and _order(tail.delivered) >= start:
                        tail._hand(entries)

    async def stop(self) -> None:
        """Stop every read (the API is stopping) and close the connections."""
        self._stopped = True
        for task in list(self._wakes):
            task.cancel()
        for reader in list(self._readers.values()):
            await stop_task(reader.task)
            await close_client(reader.client)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.delete(reader.wake_key), 2)
        self._readers.clear()
        await close_client(self.client)


def _by_key(found: Any) -> list[tuple[str, list[Entry]]]:
    """An XREAD reply's entries by stream (RESP2's list or RESP3's map)."""
    if not found:
        return []
    if isinstance(found, dict):
        return [(str(key), list(value[0])) for key, value in found.items()]
    return [(str(key), list(entries)) for key, entries in found]
