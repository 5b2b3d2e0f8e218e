"""A job that kills its worker every time it runs (sim ``crash``, exit code 70).

The harness restarts a worker that exits, as `ferry up` does. After
``FERRY_MAX_ATTEMPTS`` starts the job is dead-lettered and fails with an error
that says why; the workers go on serving everything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from harness.accounting import Accounting, Figures
from harness.faults import MODEL, Stack, sim_jobs
from harness.processes import Proc

pytestmark = pytest.mark.faults

MAX_ATTEMPTS = 3
CRASH_EXIT_CODE = 70
CRASH: dict[str, Any] = {"model": MODEL, "input": {"cost": 1, "crash": True}}


def crash_stack(make_stack: Callable[..., Stack]) -> Stack:
    stack = make_stack(
        FERRY_SIM_CRASH_ENABLED="true",
        FERRY_MAX_ATTEMPTS=str(MAX_ATTEMPTS),
        FERRY_VISIBILITY_TIMEOUT_S="3",
        FERRY_SIM_LATENCY_BASE_MS="20",
        FERRY_BATCH_MAX_SIZE="16",
    )
    stack.start_api()
    return stack


def assert_dead_lettered(
    stack: Stack, accounting: Accounting, crash_id: str, workers: list[Proc]
) -> None:
    exits = [code for worker in workers for code in worker.exits]
    accounting.figures.details["worker_exits"] = exits
    crash = accounting.rows[crash_id]
    assert crash.status == "failed", crash
    assert crash.error is not None and f"{MAX_ATTEMPTS} attempts" in crash.error, crash.error
    assert crash.attempts == MAX_ATTEMPTS, crash
    # It kills its worker as it is launched: never once computed.
    assert accounting.executions.per_job[crash_id] == 0, accounting.figures.details
    # One crash per attempt, and no other kind of exit.
    assert exits.count(CRASH_EXIT_CODE) == MAX_ATTEMPTS, exits
    assert set(exits) == {CRASH_EXIT_CODE}, exits
    assert crash_id in [entry["job"] for entry in stack.dead_letters()]
    assert all(worker.alive() for worker in workers)


def test_a_job_that_crashes_its_worker_is_dead_lettered_and_the_workers_serve_on(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack = crash_stack(make_stack)
    started = time.monotonic()
    submission = stack.submit([CRASH])
    crash_id = submission.ids[0]
    workers = stack.start_workers("w1", "w2", supervised=True)
    assert stack.wait_terminal([crash_id], timeout=60), stack.diagnostics()
    # The workers that crashed three times serve what comes next.
    later = stack.submit(sim_jobs(200))
    for index, job_id in later.ids.items():
        submission.ids[1 + index] = job_id
    submission.rejected += later.rejected
    accounting = stack.account("worker crash, alone", submission, started, 60, record)
    stack.assert_nothing_lost(accounting)
    assert_dead_lettered(stack, accounting, crash_id, workers)
    assert [entry["job"] for entry in stack.dead_letters()] == [crash_id]
    others = [r for job_id, r in accounting.rows.items() if job_id != crash_id]
    assert {r.status for r in others} == {"succeeded"}, accounting.figures.details
    assert all(r.attempts == 1 for r in others), accounting.figures.details
    # Submitted once the crashing job was dead-lettered: each computed once.
    per_job = accounting.executions.per_job
    assert all(per_job[r.id] == 1 for r in others), accounting.figures.details


def test_the_batch_mates_of_a_job_that_crashes_its_worker_succeed(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack = crash_stack(make_stack)
    bodies = sim_jobs(48)
    crash_at = 5
    bodies[crash_at] = CRASH
    started = time.monotonic()
    # Queued before the workers start, so the crashing job shares a batch of 16.
    submission = stack.submit(bodies)
    crash_id = submission.ids[crash_at]
    workers = [stack.start_worker(name, supervised=True) for name in ("w1", "w2")]
    accounting = stack.account("worker crash, in a batch", submission, started, 60, record)
    others = [r for job_id, r in accounting.rows.items() if job_id != crash_id]
    failed = [(r.status, r.attempts, r.error) for r in others if r.status != "succeeded"]
    accounting.figures.details["innocent_failed"] = len(failed)
    stack.assert_nothing_lost(accounting)
    assert_dead_lettered(stack, accounting, crash_id, workers)
    # They were started with it each time; they must not pay for it.
    assert not failed, f"{len(failed)} of its batch mates did not succeed, e.g. {failed[:2]}"
    assert [entry["job"] for entry in stack.dead_letters()] == [crash_id]
