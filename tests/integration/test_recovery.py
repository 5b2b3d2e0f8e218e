"""Recovery on real Redis and real databases: reclaiming, reconciling, regrouping."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
import redis

from core.config.settings import Settings
from core.db.schema import Job
from core.streams.protocol import GROUP, stream_key
from tests.integration.conftest import RunningLoop, Stack, build_sim_loop
from tests.streams import forget_model, model_messages
from workers.gpu.consumer import StreamConsumer
from workers.gpu.recorder import Outcome
from workers.tasks.app import RECONCILE_LOCK_S, RECONCILE_TASK, create_celery, reconcile_streams
from workers.tasks.reconcile import reconcile


def later(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)


def stream_jobs(stack: Stack) -> list[str]:
    return [m.job_id for m in model_messages(stack.redis, stack.settings.key_prefix, "sim")]


def reconcile_on(stack: Stack, *args: Any, **kwargs: Any) -> int:
    """``reconcile`` over the stack's database and Redis (its grace and the rest as given)."""
    return reconcile(stack.sessions, stack.redis, stack.settings.key_prefix, *args, **kwargs)


def test_another_worker_takes_over_entries_a_dead_one_left(stack: Stack) -> None:
    ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(6)]
    dead = StreamConsumer(stack.redis, stack.settings.key_prefix, "sim", "dead-worker")
    dead.ensure_groups()
    assert len(dead.read(10, None)) == 6  # read, then never acknowledged: it "died"
    survivor = stack.settings.model_copy(update={"visibility_timeout_s": 0.6})
    with RunningLoop(build_sim_loop(survivor, name="survivor")):
        rows = stack.wait(ids, timeout=20)
    assert {r.status for r in rows.values()} == {"succeeded"}
    assert stack.pending() == 0


def test_touched_entries_are_not_reclaimed(redis_client: redis.Redis, settings: Settings) -> None:
    stream = stream_key(settings.key_prefix, "sim", "normal")
    holder = StreamConsumer(redis_client, settings.key_prefix, "sim", "holder")
    other = StreamConsumer(redis_client, settings.key_prefix, "sim", "other")
    holder.ensure_groups()
    for i in range(3):
        redis_client.xadd(stream, {"v": "1", "job": f"j{i}", "lane": "normal", "cost": "1",
                                   "enq": "0"})  # fmt: skip
    held = holder.read(10, None)
    time.sleep(0.3)
    holder.touch(held)  # the holder is alive: its entries are fresh again
    assert other.reclaim(200, 10) == []
    time.sleep(0.3)  # now it stopped touching them
    taken = other.reclaim(200, 10)
    assert sorted(e.message.job_id for e in taken) == ["j0", "j1", "j2"]
    # The holder wakes up: it must not take them back, and learns they are gone.
    assert sorted(e.message.job_id for e in holder.touch(held)) == ["j0", "j1", "j2"]
    owners: Any = redis_client.xpending_range(stream, GROUP, "-", "+", 10)
    assert {o["consumer"] for o in owners} == {"other"}


def test_reconcile_re_enqueues_only_what_was_lost(stack: Stack) -> None:
    lost = [stack.submit(model="sim", input={"cost": 1}) for _ in range(4)]
    forget_model(stack.redis, stack.settings.key_prefix, "sim")  # Redis "lost its data"
    kept = [stack.submit(model="sim", input={"cost": 2}) for _ in range(2)]
    with stack.sessions() as session:  # a finished job is never re-enqueued
        job = session.get(Job, lost[0])
        assert job is not None
        job.status, job.finished_at = "succeeded", job.created_at
        session.commit()

    # Within the grace nothing is touched: the API may still be about to XADD.
    assert reconcile_on(stack, grace_s=60) == 0
    assert reconcile_on(stack, 60, now=later(120)) == 3
    assert sorted(stream_jobs(stack)) == sorted(lost[1:] + kept)
    # Run again: everything has its entry now, nothing is doubled.
    assert reconcile_on(stack, 60, now=later(120)) == 0
    assert len(stream_jobs(stack)) == 5


def test_a_worker_survives_redis_losing_its_groups(stack: Stack) -> None:
    with RunningLoop(build_sim_loop(stack.settings)):
        first = [stack.submit(model="sim", input={"cost": 1}) for _ in range(3)]
        stack.wait(first)
        forget_model(stack.redis, stack.settings.key_prefix, "sim")  # streams and groups gone
        # Accepted now: in the database; the entries go to streams with no group.
        second = [stack.submit(model="sim", input={"cost": 1}) for _ in range(3)]
        # The worker's reads fail with NOGROUP; it makes the groups again.
        rows = stack.wait(second, timeout=20)
    assert {r.status for r in rows.values()} == {"succeeded"}


def test_the_reconciler_is_scheduled_and_runs_one_at_a_time(
    settings: Settings, redis_client: redis.Redis
) -> None:
    app = create_celery(settings.model_copy(update={"reconcile_interval_s": 7.0}))
    entry = app.conf.beat_schedule["reconcile"]
    assert entry["task"] == RECONCILE_TASK and entry["schedule"] == 7.0
    assert reconcile_streams(settings) == 0  # nothing to do, and the lock is released
    assert not redis_client.exists(f"{settings.key_prefix}:reconcile:lock")
    redis_client.set(f"{settings.key_prefix}:reconcile:lock", "1", ex=30)
    assert reconcile_streams(settings) == 0  # another run holds the lock: skipped


def test_a_reconcile_run_that_lost_its_lock_stops_before_the_next_model(stack: Stack) -> None:
    lost = [stack.submit(model="sim", input={"cost": 1}) for _ in range(3)]
    forget_model(stack.redis, stack.settings.key_prefix, "sim")
    asked: list[int] = []

    def lost_the_lock() -> bool:
        asked.append(1)
        return False

    # Another run took the lock over: this one enqueues nothing more.
    assert reconcile_on(stack, 60, later(120), lost_the_lock) == 0
    assert asked and stream_jobs(stack) == []
    assert reconcile_on(stack, 60, later(120)) == 3
    assert sorted(stream_jobs(stack)) == sorted(lost)


def test_the_reconcilers_lock_is_short_and_renewed_while_the_run_goes_on(
    settings: Settings, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that dies holding the lock (its worker killed; its Redis failing over after the
    lock reached the replica) holds the next runs off for seconds, not minutes."""
    lock = f"{settings.key_prefix}:reconcile:lock"
    seen: list[tuple[int, bool, int]] = []

    def run(sessions: object, client: redis.Redis, prefix: str, grace_s: float, **kw: Any) -> int:
        first = int(redis_client.pttl(lock))
        time.sleep(1.0)
        kept = kw["held"]()
        seen.append((first, kept, int(redis_client.pttl(lock))))
        return 0

    monkeypatch.setattr("workers.tasks.app.reconcile", run)
    assert reconcile_streams(settings) == 0
    ((first, kept, renewed),) = seen
    assert 0 < first <= RECONCILE_LOCK_S * 1000
    assert kept and renewed > first - 500  # renewed to its full term, not left to run down
    assert not redis_client.exists(lock)


def test_a_result_the_database_refuses_fails_that_job_alone(
    stack: Stack, database_url: str
) -> None:
    ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(3)]
    loop = build_sim_loop(stack.settings)
    now = dt.datetime.now(dt.UTC)
    outcomes = [
        Outcome(ids[0], "succeeded", output={"ok": 1}),
        # PostgreSQL's JSON has no NaN: the database refuses this one.
        Outcome(ids[1], "succeeded", output={"bad": float("nan")}),
        Outcome(ids[2], "succeeded", output={"ok": 2}),
    ]
    written = loop.recording.record(outcomes, now, "batch-1", 3, [])
    assert sorted(written) == sorted(ids)  # every job got exactly one outcome
    with stack.sessions() as session:
        rows = {j.id: j for j in session.query(Job).filter(Job.id.in_(ids))}
    assert rows[ids[0]].status == rows[ids[2]].status == "succeeded"
    if database_url.startswith("postgresql"):
        assert rows[ids[1]].status == "failed"
        assert rows[ids[1]].error == "the result could not be stored (DataError)"
