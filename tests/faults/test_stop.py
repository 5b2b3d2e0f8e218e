"""SIGTERM during a long batch: the batch finishes, is recorded once, the worker exits 0."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import MODEL, Stack, sim_batches, sim_jobs, without_nonce
from harness.processes import wait_for

pytestmark = pytest.mark.faults

DRAIN_S = 10.0


def test_sigterm_mid_batch_finishes_the_batch_and_exits_zero(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack = make_stack(**sim_batches(20, 1), FERRY_WORKER_DRAIN_S=str(DRAIN_S))
    (worker,) = stack.start("w1")
    started = time.monotonic()
    long_job = stack.submit([{"model": MODEL, "input": {"cost": 3000}}])  # a 3 s batch
    (long_id,) = long_job.accepted
    wait_for(
        "the long batch to start", lambda: stack.statuses([long_id]) == {long_id: "running"}, 30
    )
    # Work that arrives while it runs: read, perhaps, but not started.
    more = stack.submit(sim_jobs(30))

    stack.signal(worker, signal.SIGTERM)
    signalled, signalled_wall = time.monotonic(), time.time()
    assert worker.popen is not None
    try:
        code = worker.popen.wait(timeout=DRAIN_S + 5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within {DRAIN_S + 5} s:\n{stack.tail(worker)}")
    exited_after = time.monotonic() - signalled
    assert code == 0, stack.tail(worker)
    assert exited_after < DRAIN_S, exited_after
    row = stack.rows([long_id])[long_id]
    assert row.status == "succeeded" and row.attempts == 1, row
    assert without_nonce(row.output) == {"cost": 3000}
    # It was mid-batch when told to stop, and its result was recorded after.
    assert row.started_at.timestamp() < signalled_wall < row.finished_at.timestamp(), row

    # The rest: a worker of the same name takes back what the stopped one had read.
    stack.start_worker("w1")
    submission = long_job
    for index, job_id in more.ids.items():
        submission.ids[index + 1] = job_id
    accounting = stack.account("SIGTERM mid-batch", submission, started, 60, record)
    stack.assert_nothing_lost(accounting)
    stack.assert_computed_once(accounting)  # what was read and not started ran once, later
    assert {r.status for r in accounting.rows.values()} == {"succeeded"}
    assert all(r.attempts == 1 for r in accounting.rows.values()), accounting.figures.details
    assert accounting.published[long_id] == 1
    accounting.figures.details["exit_after_sigterm_s"] = round(exited_after, 2)
