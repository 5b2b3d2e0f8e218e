"""Per-key request rate limits, counted in Redis so they hold across API processes.

The ``limits`` library's sliding-window counter: two Redis keys per limit and
key, no per-request history. A request over a limit is a 429 that names the
limit and carries ``Retry-After``. While Redis is unreachable requests are not
limited (jobs are still accepted without Redis, DESIGN.md §4); the log says so.
"""

from __future__ import annotations

import logging
import math
import time

from limits import RateLimitItem, parse_many
from limits.storage import RedisStorage
from limits.strategies import SlidingWindowCounterRateLimiter

from api.errors import ApiError

log = logging.getLogger(__name__)

SKIP_AFTER_FAILURE_S = 5.0


class RequestLimits:
    def __init__(self, redis_url: str, prefix: str, spec: str) -> None:
        self.items: list[RateLimitItem] = parse_many(spec) if spec else []
        # Short timeouts: a hung Redis must cost a request little, and only once.
        self.storage = RedisStorage(
            redis_url, key_prefix=f"{prefix}:limits", socket_timeout=0.25,
            socket_connect_timeout=0.25,
        )  # fmt: skip
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)
        self._skip_until = 0.0

    def check(self, key_id: str) -> None:
        """Count one request of this key; a 429 if it is over any limit."""
        if time.monotonic() < self._skip_until:
            return
        for item in self.items:
            try:
                allowed = self.limiter.hit(item, "requests", key_id)
                if allowed:
                    continue
                stats = self.limiter.get_window_stats(item, "requests", key_id)
            except Exception as exc:  # redis errors, wrapped or not: do not limit blind
                # Not limited for a while, rather than every request paying the timeout.
                self._skip_until = time.monotonic() + SKIP_AFTER_FAILURE_S
                log.warning(
                    "rate limits not checked for a while",
                    extra={"error_type": type(exc).__name__, "for_s": SKIP_AFTER_FAILURE_S},
                )
                return
            retry_s = max(1, math.ceil(stats.reset_time - time.time()))
            raise ApiError(
                429,
                "rate_limited",
                f"request rate limit {item} exceeded for this key; retry in {retry_s} s",
                {"Retry-After": str(retry_s)},
            )
