"""A job computed twice is hidden by the conditional write and shown by the execution record.

The reconciler gives a running job whose entry Redis lost a new entry; a
second worker can then claim it while the first still computes. Here that is
done on purpose: the first worker's result is written, the second's refused,
so the row and the done channel each show one result, and the fault suite's
count from the workers' execution record shows the job computed twice.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.db.schema import Job
from core.streams.protocol import JobMessage, Scripts, done_channel
from core.streams.queues import lane_depths
from harness.accounting import count_executions
from harness.processes import wait_for
from tests.integration.conftest import RunningLoop, build_sim_loop, submit, wait_terminal
from workers.gpu.executions import read_executions

BATCH_S = 1.5  # long enough for the second worker to claim the job while it computes


def test_a_job_computed_twice_shows_in_the_record_though_one_result_is_written(
    settings: Settings,
    token: str,
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    record = tmp_path / "executions"
    own = settings.model_copy(
        update={
            "execution_log_dir": record,
            "model_parameters": settings.model_parameters
            | {"sim": {"latency_base_ms": BATCH_S * 1000, "latency_per_cost_ms": 0.0}},
            "prefetch": 1,  # the first worker holds its one entry, never the second
        }
    )
    announced: list[str] = []
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(done_channel(own.key_prefix))
    auth = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(own)) as client, RunningLoop(build_sim_loop(own, "first")):
        job_id = submit(client, auth, model="sim", input={"cost": 1})

        def running() -> bool:
            with sessions() as session:
                job = session.get(Job, job_id)
                return job is not None and job.status == "running"

        wait_for("the first worker to claim the job", running, 15)
        with sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None
            Scripts(redis_client).enqueue(
                redis_client, own.key_prefix, "sim", JobMessage.of_job(job)
            )
        with RunningLoop(build_sim_loop(own, "second")):
            (row,) = wait_terminal(sessions, [job_id], timeout=15).values()
            wait_for(
                "both entries acknowledged",
                lambda: sum(lane_depths(redis_client, own.key_prefix, "sim").values()) == 0,
                15,
            )
    until = time.monotonic() + 2
    while time.monotonic() < until:
        message = pubsub.get_message(timeout=0.1)
        if message is not None:
            announced += str(message["data"]).split(",")
    pubsub.close()

    # What the write path shows: one result, announced once (the second claim
    # counted an attempt, nothing more).
    assert row.status == "succeeded" and row.attempts == 2, row
    assert announced == [job_id]
    # What the record shows: computed twice, by two workers that are both alive.
    executions = read_executions(record)
    assert sorted((e.worker, e.jobs) for e in executions) == [
        ("first", ((job_id, 1),)),
        ("second", ((job_id, 2),)),
    ]
    counted = count_executions(executions, died=set())
    assert counted.per_job[job_id] == 2
    assert counted.run_twice[job_id] == 1
    assert not counted.after_crash
