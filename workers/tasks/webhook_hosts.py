"""Receivers that do not answer are held off, so they never hold up the others.

Every attempt takes a Celery worker's slot until its receiver answers or the
timeout passes. A receiver that accepts connections and never answers (or a
host that drops them) would take every slot in turn, and every other
receiver's webhooks would wait behind it. So, per receiver (the URL's host and
port), across every Celery worker, in Redis:

- at most ``concurrency`` attempts are in flight at once; an attempt beyond
  that is not made, and its delivery is due again a moment later
  (:data:`BUSY_RETRY_S`), without counting an attempt;
- after ``failures`` attempts in a row that timed out (connecting, or
  waiting for the answer), the receiver is held off for ``hold_s``: its
  deliveries are due again when that ends, without counting attempts. One
  that answers (any HTTP status) clears the count; one refused or reset at
  once neither counts nor clears (it held no slot).

A slot is a member of a sorted set scored with when its lease ends, so a
Celery worker killed mid-attempt frees it once the lease has passed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from urllib.parse import urlsplit

import redis
from redis.commands.core import Script

# A delivery whose receiver has all its attempts in flight is due again after this.
BUSY_RETRY_S = 1.0

_ENTER = """
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
if held > tonumber(ARGV[1]) then return held end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return -1 end
redis.call('ZADD', KEYS[1], ARGV[1] + ARGV[3], ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 0
"""
_LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[2])
if ARGV[1] == 'answered' then redis.call('DEL', KEYS[3]) return 0 end
if ARGV[1] ~= 'silent' then return 0 end
local failures = redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
if failures < tonumber(ARGV[4]) then return 0 end
redis.call('DEL', KEYS[3])
redis.call('SET', KEYS[2], ARGV[3] + ARGV[5], 'PX', ARGV[5])
return 1
"""


def receiver_of(url: str) -> str:
    """The receiver a URL names: its host and port."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{(parts.hostname or '').lower()}:{port}"


@dataclass(frozen=True)
class Entered:
    """An attempt may go (``token`` names its slot), or not before ``retry_at_s``."""

    token: str | None
    retry_at_s: float | None = None
    held: bool = False  # the receiver is held off (else: all its slots are taken)


@dataclass(eq=False)
class HostGate:
    """The per-receiver limits above, in Redis under ``prefix``."""

    client: redis.Redis
    prefix: str
    _: KW_ONLY
    concurrency: int
    failures: int
    hold_s: float
    lease_s: float
    clock: Callable[[], float] = time.time
    _enter: Script = field(init=False, repr=False)
    _leave: Script = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._enter = self.client.register_script(_ENTER)
        self._leave = self.client.register_script(_LEAVE)

    def _keys(self, receiver: str) -> list[str]:
        base = f"{self.prefix}:webhook-receiver:{{{receiver}}}"
        return [f"{base}:in-flight", f"{base}:held-until", f"{base}:failures"]

    def enter(self, receiver: str) -> Entered:
        now_ms = int(self.clock() * 1000)
        token = uuid.uuid4().hex
        found = int(
            self._enter(
                keys=self._keys(receiver),
                args=[now_ms, self.concurrency, int(self.lease_s * 1000), token],
            )
        )
        if found == 0:
            return Entered(token)
        if found < 0:
            return Entered(None, now_ms / 1000.0 + BUSY_RETRY_S)
        return Entered(None, found / 1000.0, held=True)

    def leave(self, receiver: str, token: str, outcome: str) -> bool:
        """The attempt ended: ``answered`` (any HTTP status), ``silent`` (timed out) or
        ``other``. True when this one put the receiver on hold."""
        now_ms = int(self.clock() * 1000)
        return bool(
            self._leave(
                keys=self._keys(receiver),
                args=[outcome, token, now_ms, self.failures, int(self.hold_s * 1000)],
            )
        )
