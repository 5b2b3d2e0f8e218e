"""A worker stalled mid-batch past the visibility timeout: its batch is computed twice.

SIGSTOP, then SIGCONT once the other worker has taken the stalled one's
entries over. The stalled worker resumes, lands its batch and writes it: the
conditional UPDATE refuses the earlier attempt's result, so each job has one
result and one announcement. Only the execution record shows the work
done twice: the scenario the fault suite's "run twice" count is there to see
(and which the other scenarios assert never happens).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack, sim_jobs
from harness.processes import wait_for
from tests.faults.test_kill import stopped_mid_batch, two_workers

pytestmark = pytest.mark.faults

JOBS = 800
VISIBILITY_TIMEOUT_S = 2.0
# Long batches: most moments the worker is stopped at (stopped_mid_batch), it runs one.
BATCH_BASE_MS = 400


def test_a_worker_stalled_past_the_visibility_timeout_is_seen_computing_its_batch_twice(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack, stalled, _other = two_workers(make_stack, VISIBILITY_TIMEOUT_S, BATCH_BASE_MS)
    started = time.monotonic()
    submission, submitted = stack.submit_in_background(sim_jobs(JOBS))
    caught = stopped_mid_batch(stack, stalled)
    # Until w2 has claimed the batch again (its second attempt). The stop may land
    # inside the transaction that records the stalled worker's batch before, whose
    # row locks (the key's outstanding count) hold up every other write of the key,
    # w2's and the API's, until PostgreSQL ends the idle transaction
    # (core.db.schema.IDLE_IN_TRANSACTION_S); so w2 may take it over only after that.
    wait_for(
        "w2 to take the batch over",
        lambda: all(row.attempts >= 2 for row in stack.rows(caught).values()),
        60,
    )
    stack.signal(stalled, signal.SIGCONT)
    submitted.result(timeout=120)

    accounting = stack.account("worker stalled mid-batch", submission, started, 60, record)
    f = accounting.figures
    f.details["caught_running"] = len(caught)
    context = stack.diagnostics()
    assert f.lost == 0 and not f.details["rejected"], (f, context)
    assert {r.status for r in accounting.rows.values()} == {"succeeded"}, f
    # What the writes show: one result each, announced once.
    assert f.written_twice == 0, f
    assert all(accounting.rows[job_id].attempts == 2 for job_id in caught), f
    # What the record shows: the stalled batch computed by both workers, both
    # alive, so no crash explains it; nothing computed a third time.
    per_job = accounting.executions.per_job
    assert all(per_job[job_id] == 2 for job_id in caught), f
    assert f.run_twice >= len(caught) and f.after_crash == 0, f
    assert set(per_job.values()) == {1, 2}, f
    assert stalled.alive() and stalled.starts == 1
