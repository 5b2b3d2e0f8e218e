"""When to send a request again, and after how long: the same for both clients.

A request is retried when the API says so (429 and 503 come with
``Retry-After``; 502 and 504 come from a proxy in front of it) and when no
answer came (a connection error or a timeout) — but the last only for a
request that is safe to send twice: a read, a cancel, or a submission with an
idempotency key (the client makes one for every submission), so a job is
never submitted twice however many times it is sent.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass

import httpx

RETRY_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class Retries:
    """``max_retries`` more tries after the first; backoff ``base_s`` x 2^n with full
    jitter, at most ``max_backoff_s``; a ``Retry-After`` is honoured up to ``max_retry_after_s``."""

    max_retries: int = 4
    base_s: float = 0.5
    max_backoff_s: float = 8.0
    max_retry_after_s: float = 60.0

    def should_retry(
        self, attempt: int, response: httpx.Response | None, safe_to_repeat: bool
    ) -> bool:
        """``attempt``: tries made so far (1 after the first); ``response``: None if none came."""
        if attempt > self.max_retries:
            return False
        if response is None:
            return safe_to_repeat
        if response.status_code == 429:
            return True  # refused before anything was done
        return response.status_code in RETRY_STATUSES and safe_to_repeat

    def delay_s(self, attempt: int, response: httpx.Response | None) -> float:
        """How long to wait before try ``attempt + 1``."""
        after = _retry_after_s(response) if response is not None else None
        if after is not None:
            return min(after, self.max_retry_after_s)
        return random.uniform(0, min(self.max_backoff_s, self.base_s * 2 ** (attempt - 1)))


def _retry_after_s(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (a number of seconds or an HTTP date), if there is one."""
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
