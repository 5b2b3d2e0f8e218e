"""A 30,000-line backfill survives kill -9 of the Celery worker mid-feed, or of a GPU
worker mid-batch: every input line ends with exactly one result, none missing, none twice.

Thirty thousand lines are 60 feeder chunks, so the kill lands mid-feed with most of the
file still to come; the 100,000-line run through `ferry up` is tests/e2e/test_backfill_stack.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from core.db.schema import Backfill, Job
from harness import webclient
from harness.faults import MODEL, Stack, sim_batches
from harness.processes import wait_for
from harness.witness import read_transitions, terminal_writes
from tests.faults.test_kill import stopped_mid_batch

pytestmark = pytest.mark.faults

LINES = 30_000


def body() -> bytes:
    return "".join(
        json.dumps({"custom_id": f"line-{i}", "input": {"cost": 1 + i % 5, "tag": f"line-{i}"}})
        + "\n"
        for i in range(LINES)
    ).encode()


@pytest.mark.parametrize("victim", ["celery-worker", "gpu-worker"])
def test_a_backfill_ends_with_one_result_per_line_whatever_is_killed(
    make_stack: Callable[..., Stack], victim: str
) -> None:
    stack = make_stack(
        **sim_batches(20, 0.02, max_size=256),
        FERRY_VISIBILITY_TIMEOUT_S="3",
        FERRY_RECONCILE_INTERVAL_S="1",
        FERRY_RECONCILE_GRACE_S="3",
        FERRY_BACKFILL_FEED_CHUNK="500",
        FERRY_BACKFILL_OUTSTANDING="2000",
    )
    # w1, the GPU worker killed, runs long batches (200 ms and more), so that most moments
    # it is stopped at (stopped_mid_batch), it runs one; w2, which then runs the rest of
    # the file alone, runs short ones.
    slow = {"w1": {"FERRY_SIM_LATENCY_BASE_MS": "200"}} if victim == "gpu-worker" else {}
    workers = stack.start("w1", "w2", envs=slow)
    celery = stack.spawn("celery-worker", ["celery", "worker"])
    stack.spawn("celery-beat", ["celery", "beat"], supervised=True)
    client = webclient.client(
        base_url=stack.base, headers={"Authorization": f"Bearer {stack.token}"}, timeout=120
    )
    response = client.post("/v1/backfills", params={"model": MODEL}, content=body())
    assert response.status_code == 202, response.text
    backfill_id = response.json()["id"]

    def fed_through() -> int:
        with stack.engine.connect() as conn:
            return int(
                conn.scalar(select(Backfill.fed_through).where(Backfill.id == backfill_id)) or 0
            )

    wait_for("a tenth fed", lambda: fed_through() >= LINES // 10, 120, 0.05)
    details: dict[str, Any] = {}
    if victim == "celery-worker":
        stack.kill(celery)  # mid-feed: the feeder and its lock die with it
        details["fed_at_kill"] = fed_through()
        stack.spawn("celery-worker-2", ["celery", "worker"])
    else:
        caught = stopped_mid_batch(stack, workers[0])
        stack.kill(workers[0])  # not restarted: w2 takes its entries over
        details["caught"] = len(caught)

    started = time.monotonic()

    def finished() -> bool:
        status = client.get(f"/v1/backfills/{backfill_id}").json()["status"]
        assert status in ("in_progress", "finalizing", "completed"), status
        return bool(status == "completed")

    wait_for("the backfill to complete", finished, 600, 0.5)
    details["after_kill_s"] = round(time.monotonic() - started, 1)
    resource = client.get(f"/v1/backfills/{backfill_id}").json()
    assert resource["request_counts"] == {
        "total": LINES, "completed": LINES, "failed": 0, "expired": 0, "cancelled": 0
    }, details  # fmt: skip

    with stack.engine.connect() as conn:
        rows = conn.execute(
            select(Job.id, Job.line_no, Job.status, Job.attempts).where(
                Job.backfill_id == backfill_id
            )
        ).all()
        jobs = conn.scalar(select(func.count()).select_from(Job))
    assert jobs == LINES  # one job per line, no more
    assert sorted(r.line_no for r in rows) == list(range(1, LINES + 1))
    assert {r.status for r in rows} == {"succeeded"}
    assert max(r.attempts for r in rows) <= 2, details
    if victim == "gpu-worker":
        again = {r.attempts for r in rows if r.attempts == 2}
        assert again, details  # the killed batch was run again, once
    # What the sim computed, by its witness: every line, and again only what a
    # killed GPU worker had computed and not written.
    stack.wait_quiet()
    executions = stack.computations(stack.rows([r.id for r in rows]))
    assert executions.untagged == 0
    details["after_crash"] = sum(executions.after_crash.values())
    assert not executions.run_twice, (details, sorted(executions.run_twice)[:20])
    most = 2 if victim == "gpu-worker" else 1
    assert {executions.per_job[r.id] for r in rows} <= set(range(1, most + 1)), details
    # Each line's job made terminal once, by the database's transition log.
    writes = terminal_writes(read_transitions(stack.engine, [r.id for r in rows]))
    assert sorted(set(writes.values())) == [1] and len(writes) == LINES, details

    lines = client.get(f"/v1/backfills/{backfill_id}/results").text.splitlines()
    results = [json.loads(line) for line in lines]
    assert [r["custom_id"] for r in results] == [f"line-{i}" for i in range(LINES)]
    assert [r["output"]["cost"] for r in results] == [1 + i % 5 for i in range(LINES)]
