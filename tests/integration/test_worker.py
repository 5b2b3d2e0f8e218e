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
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Job, utcnow
from core.streams.protocol import JobMessage, dead_letter_key, stream_key
from tests.integration.conftest import RunningLoop, build_sim_loop
from tests.streams import lane_pending, lane_stream_names
from workers.gpu.recorder import Outcome, Recorder


def submit(client: TestClient, auth: dict[str, str], **body: Any) -> str:
    response = client.post("/v1/jobs", json=body, headers=auth)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def wait_terminal(
    sessions: sessionmaker[Session], ids: list[str], timeout: float = 15
) -> dict[str, Job]:
    until = time.monotonic() + timeout
    while True:
        with sessions() as session:
            rows = {j.id: j for j in session.query(Job).filter(Job.id.in_(ids))}
        if all(r.status not in ("queued", "running") for r in rows.values()) and len(rows) == len(
            ids
        ):
            return rows
        assert time.monotonic() < until, {k: v.status for k, v in rows.items()}
        time.sleep(0.05)


def pending_count(client: redis.Redis, settings: Settings, lane: str = "normal") -> int:
    return lane_pending(client, settings.key_prefix, "sim", lane)


def test_queued_jobs_run_in_batches_and_are_acknowledged(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    sim_worker: Callable[..., RunningLoop],
    redis_client: redis.Redis,
    settings: Settings,
) -> None:
    ids = [submit(client, auth, model="sim", input={"cost": i + 1}) for i in range(20)]
    with sim_worker() as loop:
        rows = wait_terminal(sessions, ids)
    assert {r.status for r in rows.values()} == {"succeeded"}
    assert all(rows[i].output == {"cost": rows[i].cost} for i in ids)
    sizes = {r.batch_id: r.batch_size for r in rows.values()}
    assert max(s or 0 for s in sizes.values()) > 1, sizes
    limit = settings.tuning.batch_max_size
    assert limit is not None  # set by the fixture, not derived
    assert all((s or 0) <= limit for s in sizes.values())
    assert sum(s or 0 for s in sizes.values()) == 20  # each job in exactly one batch
    assert loop.stats.jobs == 20
    assert pending_count(redis_client, settings) == 0
    # Acknowledged entries are deleted: the streams hold only live work.
    streams = lane_stream_names(redis_client, settings.key_prefix, "sim", "normal")
    assert len(streams) == 2  # the shared stream and the key's
    assert [redis_client.xlen(stream) for stream in streams] == [0, 0]
    models = client.get("/v1/models", headers=auth).json()["data"]
    assert next(m for m in models if m["name"] == "sim")["queue_depth"]["normal"] == 0


def test_a_poison_input_fails_alone(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    sim_worker: Callable[..., RunningLoop],
) -> None:
    good = [submit(client, auth, model="sim", input={"cost": 1}) for _ in range(5)]
    bad = submit(client, auth, model="sim", input={"cost": 1, "fail": True})
    good += [submit(client, auth, model="sim", input={"cost": 1}) for _ in range(2)]
    with sim_worker():
        rows = wait_terminal(sessions, [*good, bad])
    assert rows[bad].status == "failed"
    assert "SimulatedFailure" in (rows[bad].error or "")
    assert rows[bad].output is None
    assert {rows[i].status for i in good} == {"succeeded"}
    # It shared its batch with good inputs: bisection, not luck, isolated it.
    assert rows[bad].batch_id in {rows[i].batch_id for i in good}


def test_missed_deadlines_expire_without_running(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    sim_worker: Callable[..., RunningLoop],
) -> None:
    late = submit(client, auth, model="sim", input={"cost": 1}, deadline_ms=1)
    fine = submit(client, auth, model="sim", input={"cost": 1}, deadline_ms=60_000)
    time.sleep(0.05)
    with sim_worker():
        rows = wait_terminal(sessions, [late, fine])
    assert rows[late].status == "expired"
    assert rows[late].started_at is None
    assert rows[late].attempts == 0
    assert "deadline" in (rows[late].error or "")
    assert rows[fine].status == "succeeded"


def test_cancelled_jobs_are_skipped_and_acknowledged(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    sim_worker: Callable[..., RunningLoop],
    redis_client: redis.Redis,
    settings: Settings,
) -> None:
    cancelled = submit(client, auth, model="sim", input={"cost": 1})
    kept = submit(client, auth, model="sim", input={"cost": 1})
    assert client.delete(f"/v1/jobs/{cancelled}", headers=auth).status_code == 200
    with sim_worker():
        rows = wait_terminal(sessions, [cancelled, kept])
        time.sleep(0.2)
    assert rows[cancelled].status == "cancelled"
    assert rows[cancelled].started_at is None
    assert rows[kept].status == "succeeded"
    assert pending_count(redis_client, settings) == 0


def test_urgent_lane_is_served_before_bulk(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    settings: Settings,
) -> None:
    bulk = [
        submit(client, auth, model="sim", input={"cost": 1}, priority="bulk") for _ in range(12)
    ]
    urgent = submit(client, auth, model="sim", input={"cost": 1}, priority="urgent")
    loop = build_sim_loop(settings)
    loop.consumer.ensure_groups()
    loop.prefetch = 4  # room for only a few entries: the urgent one must be among them
    loop.intake.fill(None)
    assert urgent in {e.message.job_id for e in loop.pending.values()}
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    try:
        rows = wait_terminal(sessions, [urgent, *bulk])
    finally:
        stop.set()
        thread.join(10)
    first_started = min(r.started_at for r in rows.values() if r.started_at)
    assert rows[urgent].started_at == first_started


def test_a_restarted_worker_gets_back_what_it_had_read(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    settings: Settings,
) -> None:
    ids = [submit(client, auth, model="sim", input={"cost": 1}) for _ in range(3)]
    crashed = build_sim_loop(settings, name="same-name")
    crashed.consumer.ensure_groups()
    crashed.intake.fill(None)  # read (now pending in Redis), then "crash" before running
    assert len(crashed.pending) == 3
    restarted = RunningLoop(build_sim_loop(settings, name="same-name"))
    with restarted:
        rows = wait_terminal(sessions, ids)
    assert {r.status for r in rows.values()} == {"succeeded"}


def test_terminal_writes_are_conditional(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    job_id = submit(client, auth, model="sim", input={"cost": 1})
    recorder = Recorder(sessions)
    claimed, late, exhausted, _ = recorder.claim([job_id], utcnow(), 3)
    assert [c.job_id for c in claimed] == [job_id] and late == exhausted == []
    first = recorder.finish([Outcome(job_id, "succeeded", output={"x": 1})], utcnow(), "b1", 1)
    second = recorder.finish([Outcome(job_id, "failed", error="late")], utcnow(), "b2", 1)
    assert first == [job_id]
    assert second == []
    with sessions() as session:
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
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
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
        ids = [submit(client, auth, model="sim", input={"cost": 1}) for _ in range(8)]
        recorder = Recorder(sessions)
        recorder.claim(ids, stamp, 3)
        cancelled = ids[-1]
        with sessions.begin() as session:
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
        with sessions() as session:
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
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    """The read after the claim's UPDATE classifies what it left out; one that may start
    after all (the UPDATE saw an older state: made to see nothing here) is claimed, where
    falling in no list would have had its entry acknowledged and the job lost."""
    job_id = submit(client, auth, model="sim", input={"cost": 1})
    engine = sessions.kw["bind"]
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
        claimed, late, exhausted, held = Recorder(sessions).claim([job_id], utcnow(), 3)
    finally:
        event.remove(engine, "before_cursor_execute", first_claim_misses)
    assert missed
    assert [(c.job_id, c.attempts) for c in claimed] == [(job_id, 1)]
    assert late == exhausted == held == []
    with sessions() as session:
        row = session.get(Job, job_id)
        assert row is not None and (row.status, row.attempts) == ("running", 1)


def test_claim_reports_jobs_past_their_deadline(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    job_id = submit(client, auth, model="sim", input={"cost": 1}, deadline_ms=50)
    claimed, late, _, _ = Recorder(sessions).claim([job_id], utcnow() + dt.timedelta(seconds=1), 3)
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


def test_a_job_that_keeps_killing_its_worker_is_dead_lettered(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    settings: Settings,
    redis_client: redis.Redis,
) -> None:
    job_id = submit(client, auth, model="sim", input={"cost": 1})
    # Each "crash": the worker claims the job (attempts + 1) and dies before recording.
    for _ in range(settings.max_attempts):
        claimed, _, _, _ = Recorder(sessions).claim([job_id], utcnow(), settings.max_attempts)
        assert [c.job_id for c in claimed] == [job_id]
    with RunningLoop(build_sim_loop(settings)):
        rows = wait_terminal(sessions, [job_id])
    row = rows[job_id]
    assert row.status == "failed"
    assert row.attempts == settings.max_attempts
    assert f"gave up after {settings.max_attempts} attempts" in (row.error or "")
    dead: Any = redis_client.xrange(dead_letter_key(settings.key_prefix, "sim"))
    assert [fields["job"] for _, fields in dead] == [job_id]
    assert pending_count(redis_client, settings) == 0


def test_each_stage_of_a_batch_is_timed(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    sim_worker: Callable[..., RunningLoop],
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
    ids = [submit(client, auth, model="sim", input={"cost": 5}) for _ in range(12)]
    with sim_worker():
        rows = wait_terminal(sessions, ids)
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
