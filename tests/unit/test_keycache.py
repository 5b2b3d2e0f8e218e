"""The API process's key cache: requests that miss together share one lookup."""

from __future__ import annotations

import asyncio

import pytest

from api.keycache import KeyCache
from core.db.schema import ApiKey


class Lookups:
    """A lookup that takes ``seconds`` and answers ``key``; counts its calls."""

    def __init__(self, key: ApiKey | None, seconds: float = 0.05) -> None:
        self.key = key
        self.seconds = seconds
        self.calls = 0

    async def __call__(self) -> ApiKey | None:
        self.calls += 1
        await asyncio.sleep(self.seconds)
        return self.key


def test_requests_that_miss_together_make_one_lookup() -> None:
    key = ApiKey(id="k1", name="one")
    lookup = Lookups(key)
    cache = KeyCache(ttl_s=5)

    async def run() -> list[ApiKey | None]:
        found = await asyncio.gather(*(cache.looked_up("tok", lookup) for _ in range(20)))
        # Over: the next miss looks up again (a failed or expired answer is not kept here).
        await cache.looked_up("tok", lookup)
        return list(found)

    found = asyncio.run(run())
    assert found == [key] * 20
    assert lookup.calls == 2


def test_other_tokens_are_looked_up_apart() -> None:
    cache = KeyCache(ttl_s=5)
    first, second = Lookups(ApiKey(id="a")), Lookups(None)

    async def run() -> tuple[ApiKey | None, ApiKey | None]:
        a, b = await asyncio.gather(cache.looked_up("a", first), cache.looked_up("b", second))
        return a, b

    a, b = asyncio.run(run())
    assert a is not None and a.id == "a" and b is None
    assert (first.calls, second.calls) == (1, 1)


def test_a_request_given_up_on_does_not_cancel_the_shared_lookup() -> None:
    key = ApiKey(id="k1")
    lookup = Lookups(key, seconds=0.1)
    cache = KeyCache(ttl_s=5)

    async def run() -> ApiKey | None:
        leaving = asyncio.create_task(cache.looked_up("tok", lookup))
        staying = asyncio.create_task(cache.looked_up("tok", lookup))
        await asyncio.sleep(0.02)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        return await staying

    assert asyncio.run(run()) is key
    assert lookup.calls == 1


def test_a_revocation_makes_later_requests_look_up_again() -> None:
    cache = KeyCache(ttl_s=5)
    before = Lookups(ApiKey(id="k1"), seconds=0.1)
    after = Lookups(None)

    async def run() -> tuple[ApiKey | None, ApiKey | None]:
        begun = asyncio.create_task(cache.looked_up("tok", before))
        await asyncio.sleep(0.02)
        cache.forget("k1")  # revoked through this process while the lookup runs
        later = await cache.looked_up("tok", after)
        return await begun, later

    earlier, later = asyncio.run(run())
    assert earlier is not None and later is None
    assert (before.calls, after.calls) == (1, 1)


def test_without_a_cache_every_request_looks_its_key_up() -> None:
    # FERRY_KEY_CACHE_S=0 promises a lookup at every request: none is shared either.
    lookup = Lookups(ApiKey(id="k1"))
    cache = KeyCache(ttl_s=0)

    async def run() -> None:
        await asyncio.gather(*(cache.looked_up("tok", lookup) for _ in range(5)))

    asyncio.run(run())
    assert lookup.calls == 5
