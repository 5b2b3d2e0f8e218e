"""The batch loop against real Redis and real databases, with the sim model."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Job, utcnow
from core.streams.protocol import JobMessage, dead_letter_key, stream_key
from tests.integration.conftest import RunningLoop, Stack, build_sim_loop
from tests.streams import lane_pending, lane_stream_names
from workers.gpu.recorder import Outcome, Recorder


def pending_count(client: redis.Redis, settings: Settings, lane: str = "normal") -> int:
    return lane_pending(client, settings.key_prefix, "sim", lane)


def test_queued_jobs_run_in_batches_and_are_acknowledged(
    stack: Stack, sim_worker: Callable[..., RunningLoop]
) -> None:
    ids = [stack.submit(model="sim", input={"cost": i + 1}) for i in range(20)]
    with sim_worker() as loop:
        rows = stack.wait(ids)
    assert {r.status for r in rows.values()} == {"succeeded"}
    assert all(rows[i].output == {"cost": rows[i].cost} for i in ids)
    sizes = {r.batch_id: r.batch_size for r in rows.values()}
    assert max(s or 0 for s in sizes.values()) > 1, sizes
    limit = stack.settings.tuning.batch_max_size
    assert limit is not None  # set by the fixture, not derived
    assert all((s or 0) <= limit for s in sizes.values())
    assert sum(s or 0 for s in sizes.values()) == 20  # each job in exactly one batch
    assert loop.stats.jobs == 20
    assert stack.pending() == 0
    # Acknowledged entries are deleted: the streams hold only live work.
    streams = lane_stream_names(stack.redis, stack.settings.key_prefix, "sim", "normal")
    assert len(streams) == 2  # the shared stream and the key's
    assert [stack.redis.xlen(stream) for stream in streams] == [0, 0]
    models = stack.client.get("/v1/models", headers=stack.auth).json()["data"]
    assert next(m for m in models if m["name"] == "sim")["queue_depth"]["normal"] == 0


def test_a_poison_input_fails_alone(stack: Stack, sim_worker: Callable[..., RunningLoop]) -> None:
    good = [stack.submit(model="sim", input={"cost": 1}) for _ in range(5)]
    bad = stack.submit(model="sim", input={"cost": 1, "fail": True})
    good += [stack.submit(model="sim", input={"cost": 1}) for _ in range(2)]
    with sim_worker():
        rows = stack.wait([*good, bad])
    assert rows[bad].status == "failed"
    assert "SimulatedFailure" in (rows[bad].error or "")
    assert rows[bad].output is None
    assert {rows[i].status for i in good} == {"succeeded"}
    # It shared its batch with good inputs: bisection, not luck, isolated it.
    assert rows[bad].batch_id in {rows[i].batch_id for i in good}


def test_missed_deadlines_expire_without_running(
    stack: Stack, sim_worker: Callable[..., RunningLoop]
) -> None:
    late = stack.submit(model="sim", input={"cost": 1}, deadline_ms=1)
    fine = stack.submit(model="sim", input={"cost": 1}, deadline_ms=60_000)
    time.sleep(0.05)
    with sim_worker():
        rows = stack.wait([late, fine])
    assert rows[late].status == "expired"
    assert rows[late].started_at is None
    assert rows[late].attempts == 0
    assert "deadline" in (rows[late].error or "")
    assert rows[fine].status == "succeeded"


def test_cancelled_jobs_are_skipped_and_acknowledged(
    stack: Stack, sim_worker: Callable[..., RunningLoop]
) -> None:
    cancelled = stack.submit(model="sim", input={"cost": 1})
    kept = stack.submit(model="sim", input={"cost": 1})
    assert stack.client.delete(f"/v1/jobs/{cancelled}", headers=stack.auth).status_code == 200
    with sim_worker():
        rows = stack.wait([cancelled, kept])
        time.sleep(0.2)
    assert rows[cancelled].status == "cancelled"
    assert rows[cancelled].started_at is None
    assert rows[kept].status == "succeeded"
    assert stack.pending() == 0


def test_urgent_lane_is_served_before_bulk(stack: Stack) -> None:
    bulk = [stack.submit(model="sim", input={"cost": 1}, priority="bulk") for _ in range(12)]
    urgent = stack.submit(model="sim", input={"cost": 1}, priority="urgent")
    loop = build_sim_loop(stack.settings)
    loop.consumer.ensure_groups()
    loop.prefetch = 4  # room for only a few entries: the urgent one must be among them
    loop.intake.fill(None)
    assert urgent in {e.message.job_id for e in loop.pending.values()}
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    try:
        rows = stack.wait([urgent, *bulk])
    finally:
        stop.set()
        thread.join(10)
    first_started = min(r.started_at for r in rows.values() if r.started_at)
    assert rows[urgent].started_at == first_started


def test_a_restarted_worker_gets_back_what_it_had_read(stack: Stack) -> None:
    ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(3)]
    crashed = build_sim_loop(stack.settings, name="same-name")
    crashed.consumer.ensure_groups()
    crashed.intake.fill(None)  # read (now pending in Redis), then "crash" before running
    assert len(crashed.pending) == 3
    restarted = RunningLoop(build_sim_loop(stack.settings, name="same-name"))
    with restarted:
        rows = stack.wait(ids)
    assert {r.status for r in rows.values()} == {"succeeded"}


def test_terminal_writes_are_conditional(stack: Stack) -> None:
    job_id = stack.submit(model="sim", input={"cost": 1})
    recorder = Recorder(stack.sessions)
    claimed, late, exhausted, _ = recorder.claim([job_id], utcnow(), 3)
    assert [c.job_id for c in claimed] == [job_id] and late == exhausted == []
    first = recorder.finish([Outcome(job_id, "succeeded", output={"x": 1})], utcnow(), "b1", 1)
    second = recorder.finish([Outcome(job_id, "failed", error="late")], utcnow(), "b2", 1)
    assert first == [job_id]
    assert second == []
    with stack.sessions() as session:
        row = session.get(Job, job_id)
        assert row is not None
        assert (row.status, row.output, row.batch_id, row.error) == (
            "succeeded",
            {"x": 1},
            "b1",
            None,
        )
    again, _, _, _ = recorder.claim([job_id], utcnow(), 3)
    assert again == []  # a terminal job is never claimed again


def test_a_batch_is_written_in_one_statement_as_one_per_job_would_write_it(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A generation's text may hold anything, a NUL included (JSON's \u0000).
    outputs: list[Any] = [
        {"x": [0.1234567891234, -2.5e-08]},
        [1, 2],
        'text \x00 é "q" \\ \u2028',
        7,
        True,
        None,
    ]
    stamp = utcnow()

    def written(batched: bool) -> list[tuple[Any, ...]]:
        ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(8)]
        recorder = Recorder(stack.sessions)
        recorder.claim(ids, stamp, 3)
        cancelled = ids[-1]
        with stack.sessions.begin() as session:
            row = session.get(Job, cancelled)
            assert row is not None
            row.status = "cancelled"
        if not batched:  # one statement per job (an older SQLite, without RETURNING)
            monkeypatch.setattr("workers.gpu.recorder._batched_writes", lambda dialect: False)
        outcomes = [
            Outcome(job_id, "succeeded", output=output, inference_ms=1.5)
            for job_id, output in zip(ids, outputs, strict=False)
        ] + [
            Outcome(ids[6], "failed", error="boom"),
            Outcome(ids[6], "failed", error="boom"),  # two entries of one job
            Outcome(cancelled, "succeeded", output={"late": True}),
        ]
        done = recorder.finish(outcomes, stamp, "b1", 8)
        monkeypatch.undo()
        assert done == ids[:7]  # once each, in order; the cancelled job is left alone
        with stack.sessions() as session:
            rows = [session.get(Job, job_id) for job_id in ids]
        return [
            (r.status, r.output, r.error, r.inference_ms, r.finished_at, r.batch_id, r.batch_size)
            for r in rows
            if r is not None
        ]

    batched, per_job = written(True), written(False)
    assert batched == per_job
    assert [row[1] for row in batched[:6]] == outputs
    assert batched[6][:3] == ("failed", None, "boom")
    assert batched[7][0] == "cancelled" and batched[7][1] is None


def test_a_job_the_claims_update_missed_that_may_start_is_claimed_again_not_dropped(
    stack: Stack,
) -> None:
    """The read after the claim's UPDATE classifies what it left out; one that may start
    after all (the UPDATE saw an older state: made to see nothing here) is claimed, where
    falling in no list would have had its entry acknowledged and the job lost."""
    job_id = stack.submit(model="sim", input={"cost": 1})
    engine = stack.sessions.kw["bind"]
    missed: list[str] = []

    def first_claim_misses(
        _conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any
    ) -> tuple[str, Any]:
        if statement.startswith("UPDATE jobs SET") and "RETURNING" in statement and not missed:
            missed.append(statement)
            statement = statement.replace(" WHERE ", " WHERE 1 = 0 AND ", 1)
        return statement, parameters

    event.listen(engine, "before_cursor_execute", first_claim_misses, retval=True)
    try:
        claimed, late, exhausted, held = Recorder(stack.sessions).claim([job_id], utcnow(), 3)
    finally:
        event.remove(engine, "before_cursor_execute", first_claim_misses)
    assert missed
    assert [(c.job_id, c.attempts) for c in claimed] == [(job_id, 1)]
    assert late == exhausted == held == []
    with stack.sessions() as session:
        row = session.get(Job, job_id)
        assert row is not None and (row.status, row.attempts) == ("running", 1)


def test_claim_reports_jobs_past_their_deadline(stack: Stack) -> None:
    job_id = stack.submit(model="sim", input={"cost": 1}, deadline_ms=50)
    claimed, late, _, _ = Recorder(stack.sessions).claim(
        [job_id], utcnow() + dt.timedelta(seconds=1), 3
    )
    assert claimed == [] and late == [job_id]


def test_malformed_entries_go_to_the_dead_letter_stream(
    redis_client: redis.Redis, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    loop = build_sim_loop(settings)
    loop.consumer.ensure_groups()
    stream = stream_key(settings.key_prefix, "sim", "normal")
    redis_client.xadd(stream, {"v": "99", "job": "x"})
    good = JobMessage(str(uuid.uuid4()), "normal", 1, int(time.time() * 1000))
    redis_client.xadd(stream, good.encode())  # type: ignore[arg-type]
    loop.intake.fill(None)
    assert [e.message.job_id for e in loop.pending.values()] == [good.job_id]
    dead: Any = redis_client.xrange(dead_letter_key(settings.key_prefix, "sim"))
    assert len(dead) == 1 and "version" in dead[0][1]["reason"]
    assert pending_count(redis_client, settings) == 1  # only the good one awaits its ack


def test_a_job_that_keeps_killing_its_worker_is_dead_lettered(stack: Stack) -> None:
    job_id = stack.submit(model="sim", input={"cost": 1})
    max_attempts = stack.settings.max_attempts
    # Each "crash": the worker claims the job (attempts + 1) and dies before recording.
    for _ in range(max_attempts):
        claimed, _, _, _ = Recorder(stack.sessions).claim([job_id], utcnow(), max_attempts)
        assert [c.job_id for c in claimed] == [job_id]
    with RunningLoop(build_sim_loop(stack.settings)):
        rows = stack.wait([job_id])
    row = rows[job_id]
    assert row.status == "failed"
    assert row.attempts == max_attempts
    assert f"gave up after {max_attempts} attempts" in (row.error or "")
    dead: Any = stack.redis.xrange(dead_letter_key(stack.settings.key_prefix, "sim"))
    assert [fields["job"] for _, fields in dead] == [job_id]
    assert stack.pending() == 0


def test_each_stage_of_a_batch_is_timed(
    stack: Stack, sim_worker: Callable[..., RunningLoop]
) -> None:
    stages = ("prepare", "compute", "record", "acknowledge")

    def counts() -> dict[str, float]:
        return {
            stage: REGISTRY.get_sample_value(
                "ferry_batch_stage_seconds_count", {"model": "sim", "stage": stage}
            )
            or 0.0
            for stage in stages
        }

    before = counts()
    ids = [stack.submit(model="sim", input={"cost": 5}) for _ in range(12)]
    with sim_worker():
        rows = stack.wait(ids)
    batches = len({row.batch_id for row in rows.values()})
    after = counts()
    # The sim model prepares apart from computing: every batch goes through all four.
    assert {stage: after[stage] - before[stage] for stage in stages} == dict.fromkeys(
        stages, float(batches)
    )
    computed = REGISTRY.get_sample_value(
        "ferry_batch_stage_seconds_sum", {"model": "sim", "stage": "compute"}
    )
    assert computed is not None and computed > 0
