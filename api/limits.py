"""Rate limits, counted in Redis so they hold across API processes: requests per
key, and failed authentications per client address (checked before any key is
looked up, so guessing keys cannot keep the database busy).

The ``limits`` library's sliding-window counter: two Redis keys per limit and
key, no per-request history. A request over a limit is a 429 that names the
limit and carries ``Retry-After``. While Redis is unreachable requests are not
limited (jobs are still accepted without Redis, docs/architecture.md §4); the log says so.
"""

from __future__ import annotations

import logging
import math
import time

from limits import RateLimitItem, parse_many
from limits.storage import RedisStorage
from limits.strategies import SlidingWindowCounterRateLimiter
from limits.util import WindowStats

from api.errors import ApiError

log = logging.getLogger(__name__)

SKIP_AFTER_FAILURE_S = 5.0
SUSPECTS_MAX = 10_000


class RequestLimits:
    """Requests per key, and failed authentications per client address."""

    def __init__(self, redis_url: str, prefix: str, spec: str, failures: str = "") -> None:
        self.items: list[RateLimitItem] = parse_many(spec) if spec else []
        self.failure_items: list[RateLimitItem] = parse_many(failures) if failures else []
        # Short timeouts: a hung Redis must cost a request little, and only once.
        self.storage = RedisStorage(
            redis_url, key_prefix=f"{prefix}:limits", socket_timeout=0.25,
            socket_connect_timeout=0.25,
        )  # fmt: skip
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)
        self._skip_until = 0.0
        # Addresses this process saw fail lately: only they are looked up in Redis
        # before authenticating, so a healthy request costs no extra round trip.
        self._suspects: dict[str, float] = {}

    def check(self, key_id: str) -> None:
        """Count one request of this key; a 429 if it is over any limit."""
        for item in self.items:
            stats = self._over(item, True, "requests", key_id)
            if stats is not None:
                raise _refusal(f"request rate limit {item} exceeded for this key", stats)

    def refuse_if_failing(self, address: str) -> None:
        """A 429, before any key is looked up, for an address over its failed-auth limit."""
        if self._suspects.get(address, 0.0) < time.monotonic():
            return
        for item in self.failure_items:
            stats = self._over(item, False, "auth-failures", address)
            if stats is not None:
                raise _refusal(f"too many failed authentications ({item}) from this address", stats)

    def failed(self, address: str) -> None:
        """Count one failed authentication from this address."""
        now = time.monotonic()
        if len(self._suspects) > SUSPECTS_MAX:
            self._suspects = {a: until for a, until in self._suspects.items() if until > now}
        if self.failure_items:
            self._suspects[address] = now + max(i.get_expiry() for i in self.failure_items)
        for item in self.failure_items:
            self._over(item, True, "auth-failures", address)

    def _over(self, item: RateLimitItem, count: bool, *identifiers: str) -> WindowStats | None:
        """The window's stats if ``identifiers`` are over ``item`` (counting a hit if asked)."""
        if time.monotonic() < self._skip_until:
            return None
        try:
            allowed = (
                self.limiter.hit(item, *identifiers)
                if count
                else self.limiter.test(item, *identifiers)
            )
            return None if allowed else self.limiter.get_window_stats(item, *identifiers)
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
