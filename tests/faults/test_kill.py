"""kill -9 one of two workers mid-batch: the other takes its entries over; all run once."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness.accounting import RECORDING_DEPTH, Figures
from harness.faults import MODEL, Stack, sim_batches, sim_jobs
from harness.processes import Proc, stopped_when, wait_for
from tests.streams import held_jobs

pytestmark = pytest.mark.faults

JOBS = 2500
VISIBILITY_TIMEOUT_S = 3.0
BATCH_MAX_SIZE = 32
# A batch's base latency in the kill scenario: long batches, so that most moments the
# victim is stopped at (stopped_mid_batch), it runs one.
KILL_BATCH_BASE_MS = 200


def running_held_by(stack: Stack, consumer: str) -> list[str]:
    """Jobs the consumer holds (read, not acknowledged) whose rows say they are running."""
    held = held_jobs(stack.redis, stack.prefix, MODEL, consumer)
    return [row.id for row in stack.rows(held).values() if row.status == "running"]


def two_workers(
    make_stack: Callable[..., Stack], visibility_timeout_s: float, base_ms: int = 100
) -> tuple[Stack, Proc, Proc]:
    """The API and workers w1 and w2, whose batches of up to 32 jobs take ``base_ms`` + 1 ms
    per unit of cost."""
    stack = make_stack(
        FERRY_VISIBILITY_TIMEOUT_S=str(visibility_timeout_s),
        **sim_batches(base_ms, 1, max_size=BATCH_MAX_SIZE),
    )
    stack.start_api()
    return stack, stack.start_worker("w1"), stack.start_worker("w2")


def stopped_mid_batch(stack: Stack, worker: Proc, timeout_s: float = 60) -> list[str]:
    """Stops ``worker`` (SIGSTOP) at a moment it runs a batch; returns the batch's jobs
    (harness.processes.stopped_when). The caller kills it, or lets it go on later."""
    return stopped_when(
        lambda signum: stack.signal(worker, signum),
        lambda: running_held_by(stack, worker.name),
        f"{worker.name} to run a batch",
        timeout_s,
    )


def test_a_worker_killed_mid_batch_is_taken_over_and_nothing_runs_twice(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack, victim, survivor = two_workers(make_stack, VISIBILITY_TIMEOUT_S, KILL_BATCH_BASE_MS)
    started = time.monotonic()
    submission, submitted = stack.submit_in_background(sim_jobs(JOBS))

    wait_for("a few hundred jobs to finish", lambda: stack.terminal_count() >= 300, 60, 0.1)
    caught = stopped_mid_batch(stack, victim)
    stack.kill(victim)  # not restarted: w2 must take its entries over
    killed_at = time.monotonic()
    # What the kill interrupted: the caught jobs the victim had not recorded (all of them:
    # it was stopped running them).
    interrupted = [j for j, row in stack.rows(caught).items() if row.status == "running"]
    submitted.result(timeout=120)

    accounting = stack.account("kill -9 a worker mid-batch", submission, started, 120, record)
    rows = accounting.rows
    details = accounting.figures.details
    details["caught_running"] = len(caught)
    details["interrupted"] = len(interrupted)
    details["killed_after_s"] = round(killed_at - started, 1)
    stack.assert_nothing_lost(accounting)
    assert {r.status for r in rows.values()} == {"succeeded"}, details
    # The batch it was running was run again, by the survivor, once.
    rerun = [job_id for job_id in interrupted if job_id in rows]
    assert rerun and all(rows[job_id].attempts == 2 for job_id in rerun), details
    assert all(r.attempts <= 2 for r in rows.values()), details
    # Computed again (by the record, not the writes): at most what the victim had
    # computed and not yet written when it died, its last batches.
    per_job = accounting.executions.per_job
    assert max(per_job[job_id] for job_id in rows) <= 2, details
    assert accounting.figures.after_crash <= RECORDING_DEPTH * BATCH_MAX_SIZE, details
    reclaims = stack.count_logs(survivor, "reclaimed entries another worker left unacknowledged")
    details["reclaims"] = reclaims
    assert reclaims > 0, details
    assert victim.starts == 1 and not victim.alive()
    assert survivor.alive() and survivor.starts == 1
