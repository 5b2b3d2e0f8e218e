"""Redis locks held by one Celery task run at a time (the reconciler, the backfill feeder),
and a gate that lets one run in per interval (beat's webhook dispatch).

A lock is a key set with ``SET NX`` to a token only its holder knows, with
an expiry, so that a holder that dies frees it by itself. Renewing and
releasing check the token first, in one script: a holder whose lock expired
and was taken by another run never renews or deletes that run's.
"""

from __future__ import annotations

import redis

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def renew(client: redis.Redis, lock: str, token: str, ttl_ms: int) -> bool:
    """Extend the lock to ``ttl_ms`` from now if ``token`` still holds it."""
    return bool(client.eval(_RENEW, 1, lock, token, ttl_ms))


def release(client: redis.Redis, lock: str, token: str) -> bool:
    """Delete the lock if ``token`` still holds it."""
    return bool(client.eval(_RELEASE, 1, lock, token))


def first_in(client: redis.Redis, key: str, interval_ms: int) -> bool:
    """Whether this is the first call for ``key`` in ``interval_ms`` (timed by Redis, so no
    host's clock matters); True too when Redis cannot be asked (the caller's work does not
    need it, and running it once more is harmless)."""
    try:
        return bool(client.set(key, "1", nx=True, px=interval_ms))
    except redis.RedisError:
        return True
