"""Per-key request rate limits, counted in Redis: a burst over the limit gets 429s with
Retry-After naming the limit; other keys are untouched; accepted jobs still complete."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.errors import ApiError
from api.limits import RequestLimits
from core.config.settings import Settings
from tests.integration.conftest import RunningLoop

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


@pytest.fixture
def limited(settings: Settings) -> Iterator[TestClient]:
    configured = settings.model_copy(update={"rate_limit": "5/second;40/minute"})
    with TestClient(create_app(configured)) as test_client:
        yield test_client


def test_a_burst_over_the_limit_is_refused_and_what_was_accepted_completes(
    limited: TestClient,
    make_token: Callable[[str], str],
    sim_worker: Callable[..., RunningLoop],
) -> None:
    greedy = {"Authorization": f"Bearer {make_token('greedy')}"}
    calm = {"Authorization": f"Bearer {make_token('calm')}"}
    responses = [
        limited.post("/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=greedy)
        for _ in range(12)
    ]
    accepted = [r.json()["id"] for r in responses if r.status_code == 202]
    refused = [r for r in responses if r.status_code == 429]
    assert len(accepted) + len(refused) == 12
    assert 1 <= len(accepted) <= 6 and refused  # 5 per second, and the second may turn over
    for response in refused:
        error = response.json()["error"]
        assert error["type"] == "rate_limited"
        assert "5 per 1 second" in error["message"]
        assert 1 <= int(response.headers["Retry-After"]) <= 2
    # Another key has a budget of its own.
    assert limited.get("/v1/jobs", headers=calm).status_code == 200
    # After Retry-After the key is served again, and its accepted jobs ran.
    time.sleep(int(refused[-1].headers["Retry-After"]))
    with sim_worker():
        deadline = time.monotonic() + 15
        while True:  # two requests a second: within the limit
            listed = limited.get("/v1/jobs?limit=50", headers=greedy)
            assert listed.status_code == 200, listed.text
            status = {job["id"]: job["status"] for job in listed.json()["data"]}
            if all(status.get(job_id) == "succeeded" for job_id in accepted):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
    assert set(status) == set(accepted)  # nothing refused was stored


def test_a_bad_rate_limit_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="is not a rate limit"):
        Settings(rate_limit="lots")


def test_an_unreachable_redis_costs_no_wait_and_the_process_still_counts() -> None:
    async def check_50() -> tuple[float, int]:
        limits = RequestLimits("redis://127.0.0.1:1/0", "nowhere", "1/second")
        started = time.monotonic()
        refused = 0
        for _ in range(50):
            try:
                await limits.check("some-key")
            except ApiError as exc:
                assert exc.status == 429
                refused += 1
        return time.monotonic() - started, refused

    elapsed_s, refused = asyncio.run(check_50())
    assert elapsed_s < 2.0  # one failed try, then Redis is left alone for a while
    # Not shared, but not blind either: this process's own count is over the limit.
    assert refused in (48, 49)  # 1 per second (the second may turn over once)


def test_an_address_that_keeps_failing_to_authenticate_is_refused_before_any_lookup(
    settings: Settings, make_token: Callable[[str], str]
) -> None:
    configured = settings.model_copy(update={"auth_failure_limit": "3/second;30/minute"})
    good = {"Authorization": f"Bearer {make_token('good')}"}
    guess = {"Authorization": "Bearer fy_0123456789abcdef_guess"}
    with TestClient(create_app(configured)) as api:
        assert [api.get("/v1/jobs", headers=guess).status_code for _ in range(3)] == [401] * 3
        refused = api.get("/v1/jobs", headers=guess)
        assert refused.status_code == 429
        assert "too many failed authentications (3 per 1 second)" in refused.text
        retry_s = int(refused.headers["Retry-After"])
        assert 1 <= retry_s <= 2
        # The address is refused whatever it sends, until the window turns over.
        assert api.get("/v1/jobs", headers=good).status_code == 429
        time.sleep(retry_s)
        assert api.get("/v1/jobs", headers=good).status_code == 200


def test_api_processes_share_each_keys_budget_through_redis(
    settings: Settings, make_token: Callable[[str], str]
) -> None:
    configured = settings.model_copy(update={"rate_limit": "10/minute"})
    headers = {"Authorization": f"Bearer {make_token('shared')}"}
    # Two apps, as two API processes would be: their own counts, one Redis.
    with TestClient(create_app(configured)) as one, TestClient(create_app(configured)) as two:
        assert [one.get("/v1/jobs", headers=headers).status_code for _ in range(6)] == [200] * 6
        time.sleep(0.5)  # one's counts reach Redis at its next sync
        statuses = [two.get("/v1/jobs", headers=headers).status_code for _ in range(6)]
        assert statuses == [200] * 4 + [429] * 2
        refused = two.get("/v1/jobs", headers=headers)
        assert "10 per 1 minute" in refused.json()["error"]["message"]
        time.sleep(0.5)
        assert one.get("/v1/jobs", headers=headers).status_code == 429  # and the other way


def test_counts_made_just_before_a_window_turns_over_still_reach_redis(
    redis_url: str, key_prefix: str
) -> None:
    async def run() -> tuple[int, int]:
        limits = RequestLimits(redis_url, key_prefix, "100/second")
        budget = limits.budget
        await asyncio.sleep(1.0 - time.time() % 1.0 + 0.05)  # early in a window
        window = int(time.time())
        for _ in range(5):
            await limits.check("key")
        await asyncio.sleep(1.0 - time.time() % 1.0 + 0.05)  # the next window, unsynced
        await limits.check("key")
        await budget._sync()
        counted = [
            int(await budget.client.get(budget._key("key", 0, w)) or 0)
            for w in (window, window + 1)
        ]
        await limits.stop()
        return counted[0], counted[1]

    assert asyncio.run(run()) == (5, 1)
