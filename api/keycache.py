"""Keys an API process has checked lately, so most requests cost no key lookup."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable

from core.db.schema import ApiKey

MAX_KEYS = 10_000


class KeyCache:
    """Valid keys by their token, each kept ``ttl_s`` from its lookup.

    A key revoked meanwhile is refused by this process once its entry
    expires, so revocation takes effect everywhere within ``ttl_s``
    (``FERRY_KEY_CACHE_S``). Tokens are held as SHA-256 digests, never as
    given, and failed lookups are not kept (they count as failures instead).
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._keys: dict[bytes, tuple[float, ApiKey]] = {}
        self._forgotten: dict[str, float] = {}  # key id -> until when it is not kept
        self._lookups: dict[bytes, asyncio.Future[ApiKey | None]] = {}  # under way, by token

    async def looked_up(
        self, token: str, lookup: Callable[[], Awaitable[ApiKey | None]]
    ) -> ApiKey | None:
        """``lookup()``'s answer for ``token``, shared by the requests that ask meanwhile: when
        a busy key's entry expires, its requests in flight make one lookup, not one each.
        With no cache (``ttl_s`` 0), each request looks its key up itself."""
        if self.ttl_s <= 0:
            return await lookup()
        digest = _digest(token)
        pending = self._lookups.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(lookup())
            self._lookups[digest] = pending

            def done(finished: asyncio.Future[ApiKey | None]) -> None:
                if self._lookups.get(digest) is finished:
                    del self._lookups[digest]

            pending.add_done_callback(done)
        # One request given up on does not cancel the lookup the others wait for.
        return await asyncio.shield(pending)

    def get(self, token: str) -> ApiKey | None:
        if self.ttl_s <= 0:
            return None
        digest = _digest(token)
        found = self._keys.get(digest)
        if found is None:
            return None
        if found[0] <= time.monotonic():
            del self._keys[digest]
            return None
        return found[1]

    def forget(self, key_id: str) -> None:
        """Drop a key revoked through this process: its next request here is looked up,
        and a lookup that began before the revocation does not put it back."""
        self._keys = {d: kept for d, kept in self._keys.items() if kept[1].id != key_id}
        self._forgotten[key_id] = time.monotonic() + self.ttl_s
        self._lookups.clear()  # a request from now on does not share one begun before

    def put(self, token: str, key: ApiKey) -> None:
        if self.ttl_s <= 0:
            return
        now = time.monotonic()
        if self._forgotten:
            self._forgotten = {k: until for k, until in self._forgotten.items() if until > now}
            if key.id in self._forgotten:
                return
        if len(self._keys) >= MAX_KEYS:
            self._keys = {d: kept for d, kept in self._keys.items() if kept[0] > now}
            if len(self._keys) >= MAX_KEYS:
                self._keys.clear()  # many live keys at once: start again rather than grow
        self._keys[_digest(token)] = (now + self.ttl_s, key)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
