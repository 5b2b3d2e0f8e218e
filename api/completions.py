"""Long-poll wake-ups: workers publish finished job ids; waiting requests wake.

The hub also remembers the jobs this process accepted whose completion has not come
(:meth:`CompletionHub.accepted`): a request that waits for one of them need not read its
row first to learn that it has not ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from api.background import close_client, stop_task
from core.streams.target import is_cluster

log = logging.getLogger(__name__)

# At most this many accepted jobs remembered as not ended (the oldest forgotten first:
# a wait for a forgotten one reads its row first, as for a job another process accepted).
UNENDED_MAX = 100_000


class CompletionHub:
    """One subscription per API process, fanned out to the requests that wait."""

    def __init__(self, client: aioredis.Redis, channel: str) -> None:
        self.client = client
        self.channel = channel
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Job id -> its key's id, for jobs accepted here whose completion has not come.
        # Added by the group commit's threads, forgotten on the loop.
        self._unended: OrderedDict[str, str] = OrderedDict()
        self._unended_lock = threading.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="completion-hub")

    async def stop(self) -> None:
        self._stopping = True
        await stop_task(self._task)
        await close_client(self.client)

    @contextlib.contextmanager
    def watch(self, job_id: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self._waiters.setdefault(job_id, set()).add(event)
        try:
            yield event
        finally:
            waiters = self._waiters.get(job_id)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[job_id]

    def accepted(self, jobs: Iterable[tuple[str, str]]) -> None:
        """Remember jobs (id, key id) accepted here, before they are enqueued: their
        completion can only come after this. Safe from any thread."""
        with self._unended_lock:
            self._unended.update(jobs)
            while len(self._unended) > UNENDED_MAX:
                self._unended.popitem(last=False)

    def __len__(self) -> int:
        """How many jobs accepted here are remembered as not ended."""
        return len(self._unended)

    def unended(self, job_id: str, key_id: str) -> bool:
        """Whether ``key_id``'s job ``job_id`` was accepted here and its completion has not
        come (so it has not ended, or its completion is on its way)."""
        return self._unended.get(job_id) == key_id

    def ended(self, job_ids: Iterable[str]) -> None:
        """Forget jobs accepted here: their completion came, a read found them ended, or
        the group commit took them back (their rows deleted again when their enqueue was
        refused, their requests answered with the refusal). (A completion may never come:
        a worker that wrote the row and died before it published, the entry then
        acknowledged by another without it. So a lost completion costs one wait its
        length, not every wait after it.)"""
        known = [job_id for job_id in job_ids if job_id in self._unended]
        if known:
            with self._unended_lock:
                for job_id in known:
                    self._unended.pop(job_id, None)

    def wake_all(self) -> None:
        """Every waiter reads its job again (completions may have been missed)."""
        with self._unended_lock:
            self._unended.clear()  # nor are the accepted jobs known not to have ended
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()

    def notify(self, job_ids: str) -> None:
        ended = job_ids.split(",")
        self.ended(ended)
        for job_id in ended:
            for event in self._waiters.get(job_id, ()):
                event.set()

    async def _listen(self) -> None:
        # A completion published while the subscription was down is lost, so on
        # every (re)subscription each waiter reads its job once; and each reads
        # it once more at the end of its wait. A lost message or a Redis outage
        # only slows a long-poll down; it never loses a result.
        while not self._stopping:
            try:
                if is_cluster(self.client):
                    # A Cluster client subscribes on the node its slot map names: learn it
                    # first. (Any node will do: a PUBLISH reaches every node.)
                    await cast(AsyncRedisCluster, self.client).initialize()
                async with self.client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.wake_all()
                    async for message in pubsub.listen():
                        data = message.get("data")
                        if isinstance(data, bytes):
                            data = data.decode()
                        if isinstance(data, str):
                            self.notify(data)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "completion subscription lost", extra={"error_type": type(exc).__name__}
                )
                await asyncio.sleep(1.0)
