"""Rate limits that hold across API processes: requests per key, and failed
authentications per client address (checked before any key is looked up, so
guessing keys cannot keep the database busy).

Both are sliding-window counters: a window's count, plus the previous
window's weighted by how much of it the sliding window still covers; no
per-request history. A request over a limit is a 429 that names the limit
and carries ``Retry-After``.

Requests per key are counted in the process (:class:`SharedBudget`): a
request costs no round trip. Each process adds its counts to the key's
shared count in Redis every ``SYNC_S`` and reads back everyone's, and the
first request of a key in a window reads the shared count before it is
decided; so all processes together admit at most what the limit allows
plus what the others admitted within one sync. While Redis is unreachable
each process still holds every key to the limit on its own count; the log
says so. Failed authentications are rare and go to Redis each time (the
``limits`` library).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from limits import RateLimitItem, parse_many
from limits.aio.strategies import SlidingWindowCounterRateLimiter
from limits.storage import storage_from_string
from limits.util import WindowStats

from api.background import close_client, stop_task
from api.errors import ApiError
from core.streams.target import REDIS_ERRORS, RedisTarget

log = logging.getLogger(__name__)

SKIP_AFTER_FAILURE_S = 5.0
SUSPECTS_MAX = 10_000


SYNC_S = 0.1


@dataclass
class _Count:
    """One key's count under one limit, in the window ``window`` (its number since the epoch)."""

    window: int
    shared: int = 0  # every process's count in the window, as of the last sync
    previous: int = 0  # every process's count in the window before
    pending: int = 0  # this process's requests not added to the shared count yet


class SharedBudget:
    """Requests per key under ``items``, counted here and shared through Redis."""

    def __init__(self, client: aioredis.Redis, prefix: str, items: list[RateLimitItem]) -> None:
        self.client = client
        self.prefix = prefix
        self.items = items
        self._counts: dict[tuple[str, int], _Count] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._warned = False
        self._skip_until = 0.0
        # Counts of windows that ended before their pending requests were synced.
        self._retiring: list[tuple[tuple[str, int], _Count]] = []

    def start(self) -> None:
        if self.items:
            self._task = asyncio.create_task(self._sync_forever(), name="rate-limit-sync")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await stop_task(self._task)
            with contextlib.suppress(Exception):
                # What was counted since the last sync; a stop never waits long on Redis.
                await asyncio.wait_for(self._sync(), timeout=1.0)
        await close_client(self.client, 1.0)

    async def check(self, key_id: str) -> None:
        """Count one request of this key; a 429 if it is over any limit (nothing counted)."""
        now = time.time()
        counts = []
        for n, item in enumerate(self.items):
            period = item.get_expiry()
            window = int(now // period)
            count = self._counts.get((key_id, n))
            if count is None or count.window != window:
                count = await self._start_window(key_id, n, item, window, count)
            weight = 1.0 - (now % period) / period
            if count.previous * weight + count.shared + count.pending + 1 > item.amount:
                retry_s = _retry_after(item, count, now)
                raise ApiError(
                    429,
                    "rate_limited",
                    f"request rate limit {item} exceeded for this key; retry in {retry_s} s",
                    {"Retry-After": str(retry_s)},
                )
            counts.append(count)
        for count in counts:
            count.pending += 1

    async def _start_window(
        self, key_id: str, n: int, item: RateLimitItem, window: int, was: _Count | None
    ) -> _Count:
        count = _Count(window)
        if was is not None and was.window == window - 1:
            count.previous = was.shared + was.pending
        self._counts[(key_id, n)] = count
        if was is not None and was.pending:
            self._retiring.append(((key_id, n), was))  # the next sync adds them to their window
        if time.monotonic() < self._skip_until:
            return count  # a Redis that just failed is not waited on at every window
        try:
            shared, previous = await self.client.mget(
                self._key(key_id, n, window), self._key(key_id, n, window - 1)
            )
            count.shared = int(shared or 0)
            count.previous = max(count.previous, int(previous or 0))
        except REDIS_ERRORS as exc:
            self._unshared(exc)
        return count

    async def _sync_forever(self) -> None:
        while not self._stopping:
            await asyncio.sleep(SYNC_S)
            try:
                await self._sync()
            except REDIS_ERRORS as exc:
                self._unshared(exc)

    async def _sync(self) -> None:
        """Add this process's pending counts to the shared ones; read back everyone's
        (for every key this process has seen in the current window)."""
        current = {n: int(time.time() // item.get_expiry()) for n, item in enumerate(self.items)}
        for k in [k for k, c in self._counts.items() if c.window < current[k[1]] - 1]:
            if not self._counts[k].pending:
                del self._counts[k]  # not seen for two windows: nothing to keep
        retiring, self._retiring = self._retiring, []
        synced = [(k, c, c.pending) for k, c in retiring] + [
            (k, c, c.pending)
            for k, c in self._counts.items()
            if c.pending or c.window == current[k[1]]
        ]
        if not synced:
            return
        pipe = self.client.pipeline(transaction=False)
        for (key_id, n), count, pending in synced:
            key = self._key(key_id, n, count.window)
            if pending:
                pipe.incrby(key, pending)
                pipe.expire(key, 2 * self.items[n].get_expiry() + 1)
            else:
                pipe.get(key)
        try:
            results = iter(await pipe.execute())
        except BaseException:
            # Tried again at the next sync; a long outage keeps the latest only.
            self._retiring = (retiring + self._retiring)[-SUSPECTS_MAX:]
            raise
        for _k, count, pending in synced:
            count.shared = int(next(results) or 0)
            if pending:
                count.pending -= pending
                next(results)  # EXPIRE's answer
        if self._warned:
            self._warned = False
            log.info("rate limits shared across API processes again")

    def _unshared(self, exc: Exception) -> None:
        self._skip_until = time.monotonic() + SKIP_AFTER_FAILURE_S
        if not self._warned:
            self._warned = True
            log.warning(
                "rate limits counted in this process only until Redis answers",
                extra={"error_type": type(exc).__name__},
            )

    def _key(self, key_id: str, n: int, window: int) -> str:
        item = self.items[n]
        # The key id is the hash tag: a window and the one before it share a Cluster slot,
        # so one MGET reads both.
        return (
            f"{self.prefix}:limits:requests:{{{key_id}}}:{item.amount}/{item.get_expiry()}:{window}"
        )


def _retry_after(item: RateLimitItem, count: _Count, now: float) -> int:
    """Whole seconds until this process would admit the key's next request under ``item``.

    Not just until the window turns over: the sliding window still weighs the
    window that ends, so a full window keeps refusing for a while after it."""
    period = item.get_expiry()
    into = now % period
    current = count.shared + count.pending
    if current + 1 <= item.amount:
        # Room in this window once enough of the previous one has slid out.
        wait = (1.0 - (item.amount - current - 1) / count.previous) * period - into
    else:
        # In the next window all of this one is the previous window, weighed down as it slides.
        wait = period - into + period * max(0.0, 1.0 - (item.amount - 1) / current)
    return max(1, math.ceil(wait - 1e-9))  # not a second more for a rounding error


class RequestLimits:
    """Requests per key, and failed authentications per client address."""

    def __init__(
        self, target: RedisTarget | str, prefix: str, spec: str, failures: str = ""
    ) -> None:
        """``target``: Ferry's Redis (a URL alone, for a single Redis)."""
        target = RedisTarget(target) if isinstance(target, str) else target
        self.items: list[RateLimitItem] = parse_many(spec) if spec else []
        # Short timeouts: a hung Redis must cost a sync little.
        self.budget = SharedBudget(
            target.async_client(socket_timeout=0.25, socket_connect_timeout=0.25),
            prefix,
            self.items,
        )
        self.failure_items: list[RateLimitItem] = parse_many(failures) if failures else []
        # Short timeouts: a hung Redis must cost a request little, and only once.
        uri, options = target.limits_uri()
        self.storage = storage_from_string(
            uri,
            implementation="redispy",
            key_prefix=f"{prefix}:limits",
            socket_timeout=0.25,
            socket_connect_timeout=0.25,
            **options,
        )
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)
        self._skip_until = 0.0
        # Addresses this process saw fail lately: only they are looked up in Redis
        # before authenticating, so a healthy request costs no extra round trip.
        self._suspects: dict[str, float] = {}

    def start(self) -> None:
        self.budget.start()

    async def stop(self) -> None:
        await self.budget.stop()

    async def check(self, key_id: str) -> None:
        """Count one request of this key; a 429 if it is over any limit."""
        await self.budget.check(key_id)

    async def refuse_if_failing(self, address: str) -> None:
        """A 429, before any key is looked up, for an address over its failed-auth limit."""
        if self._suspects.get(address, 0.0) < time.monotonic():
            return
        for item in self.failure_items:
            stats = await self._over(item, False, "auth-failures", address)
            if stats is not None:
                raise _refusal(f"too many failed authentications ({item}) from this address", stats)

    async def failed(self, address: str) -> None:
        """Count one failed authentication from this address."""
        now = time.monotonic()
        if len(self._suspects) > SUSPECTS_MAX:
            self._suspects = {a: until for a, until in self._suspects.items() if until > now}
        if self.failure_items:
            self._suspects[address] = now + max(i.get_expiry() for i in self.failure_items)
        for item in self.failure_items:
            await self._over(item, True, "auth-failures", address)

    async def _over(
        self, item: RateLimitItem, count: bool, *identifiers: str
    ) -> WindowStats | None:
        """The window's stats if ``identifiers`` are over ``item`` (counting a hit if asked)."""
        if time.monotonic() < self._skip_until:
            return None
        try:
            allowed = await (
                self.limiter.hit(item, *identifiers)
                if count
                else self.limiter.test(item, *identifiers)
            )
            return None if allowed else await self.limiter.get_window_stats(item, *identifiers)
        except Exception as exc:  # redis errors, wrapped or not: do not limit blind
            # Not limited for a while, rather than every request paying the timeout.
            self._skip_until = time.monotonic() + SKIP_AFTER_FAILURE_S
            log.warning(
                "rate limits not checked for a while",
                extra={"error_type": type(exc).__name__, "for_s": SKIP_AFTER_FAILURE_S},
            )
            return None


def _refusal(what: str, stats: WindowStats) -> ApiError:
    retry_s = max(1, math.ceil(stats.reset_time - time.time()))
    return ApiError(
        429, "rate_limited", f"{what}; retry in {retry_s} s", {"Retry-After": str(retry_s)}
    )
