"""The completion hub's record of the jobs this API process accepted and has not seen end
(api.completions): what lets a wait for one skip reading its row first."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from api import completions
from api.completions import CompletionHub


def _hub() -> CompletionHub:
    # Not started: nothing subscribes, and the client never connects.
    return CompletionHub(aioredis.Redis(), "ferry:done")


def test_an_accepted_job_is_unended_for_its_own_key_until_its_completion() -> None:
    hub = _hub()
    hub.accepted([("job-1", "key-a"), ("job-2", "key-b")])
    assert hub.unended("job-1", "key-a")
    assert not hub.unended("job-1", "key-b")  # another key's: its read answers 404
    assert not hub.unended("job-3", "key-a")  # accepted elsewhere, or never
    hub.notify("job-9,job-1")
    assert not hub.unended("job-1", "key-a")
    assert hub.unended("job-2", "key-b")


def test_a_completion_wakes_its_waiter_and_ends_the_record_at_once() -> None:
    async def main() -> None:
        hub = _hub()
        hub.accepted([("job-1", "key-a")])
        with hub.watch("job-1") as woken:
            hub.notify("job-1")
            assert woken.is_set()
            assert not hub.unended("job-1", "key-a")

    asyncio.run(main())


def test_jobs_read_as_ended_or_taken_back_are_forgotten() -> None:
    hub = _hub()
    hub.accepted([("job-1", "key-a"), ("job-2", "key-a"), ("job-3", "key-b")])
    hub.ended(["job-1"])  # a read found it ended
    hub.ended({"job-3", "job-9"})  # taken back; job-9 never accepted here: nothing to forget
    assert len(hub) == 1
    assert hub.unended("job-2", "key-a")
    assert not hub.unended("job-1", "key-a") and not hub.unended("job-3", "key-b")


def test_a_resubscription_forgets_every_record() -> None:
    """Completions published while the subscription was down are lost: after it, no job
    is taken to be unended without reading it."""
    hub = _hub()
    hub.accepted([("job-1", "key-a"), ("job-2", "key-a")])
    hub.wake_all()
    assert not hub.unended("job-1", "key-a")
    assert not hub.unended("job-2", "key-a")


def test_the_record_is_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completions, "UNENDED_MAX", 3)
    hub = _hub()
    hub.accepted([(f"job-{i}", "key-a") for i in range(3)])
    hub.accepted([("job-3", "key-a"), ("job-4", "key-a")])
    assert [hub.unended(f"job-{i}", "key-a") for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
