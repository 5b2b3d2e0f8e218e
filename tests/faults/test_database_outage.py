"""PostgreSQL unreachable for 5 s mid-run (refused, connections cut): nothing lost or doubled."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack
from harness.processes import wait_for
from tests.faults.database_down import SteadySubmissions

pytestmark = pytest.mark.faults

BACKLOG = 600
OUTAGE_S = 5.0


def test_a_database_outage_mid_run_loses_nothing_and_records_nothing_twice(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack = make_stack(
        proxy_db=True,  # the API and the workers reach PostgreSQL through the proxy
        FERRY_SIM_LATENCY_BASE_MS="50",
        # A batch of 32 takes about half a second.
        FERRY_SIM_LATENCY_PER_COST_MS="5",
        FERRY_BATCH_MAX_SIZE="32",
        FERRY_VISIBILITY_TIMEOUT_S="10",
        FERRY_RECONCILE_INTERVAL_S="1",
        FERRY_RECONCILE_GRACE_S="2",
    )
    proxy = stack.proxy
    assert proxy is not None
    stack.start_api()
    # The whole stack, reconciler included: a commit cut off after the server
    # made it is answered 503, and the client's retry then gets the job back
    # (idempotency key) although it was never queued; the reconciler queues it.
    celery_worker = stack.spawn("celery-worker", ["celery", "worker"], supervised=True)
    stack.spawn("celery-beat", ["celery", "beat"], supervised=True)
    started = time.monotonic()
    steady = SteadySubmissions(stack)
    submission, submitted = steady.submission, steady.submitted
    # A backlog first, so that both workers are busy when the fault strikes.
    wait_for("a backlog", lambda: len(submission.ids) >= BACKLOG, 60)
    workers = stack.start_workers("w1", "w2")

    wait_for("a couple of hundred jobs to finish", lambda: stack.terminal_count() >= 200, 60, 0.1)
    done_before = stack.terminal_count()
    unfinished = len(submission.ids) - stack.terminal_count()
    still_submitting = not submitted.done()
    proxy.cut()
    cut_at = time.monotonic()
    time.sleep(OUTAGE_S)  # the fault itself: the database stays unreachable this long
    proxy.restore()
    outage_s = time.monotonic() - cut_at
    steady.stop_once_accepted_again()

    accounting = stack.account("database down 5 s", submission, started, 120, record)
    details = accounting.figures.details
    details["unfinished_at_fault"] = unfinished
    details["outage_s"] = round(outage_s, 1)
    details["done_before_outage"] = done_before
    details["submitting_at_fault"] = still_submitting
    details["connections_severed"] = proxy.severed
    details["reenqueued"] = stack.reenqueued(celery_worker)
    stack.assert_nothing_lost(accounting)
    # A worker that waits for the database keeps its batch: nothing is computed twice.
    stack.assert_computed_once(accounting)
    rows = accounting.rows.values()
    assert {r.status for r in rows} == {"succeeded"}, details
    assert all(worker.alive() and worker.starts == 1 for worker in workers)
    # The outage was real: connections were cut and clients were turned away.
    assert proxy.severed > 0, details
    assert still_submitting and details["retried"], details
    assert stack.procs["api"].alive()
    details["worker_retries"] = retries = stack.write_retries(workers)
    assert all(retries.values()), f"the outage missed a worker: {retries}"
