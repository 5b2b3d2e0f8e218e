"""PostgreSQL unreachable for 5 s mid-run (refused, connections cut): nothing lost or doubled."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack
from tests.faults.database_down import DATABASE_FAULT_ENV, run_up_to_the_fault

pytestmark = pytest.mark.faults

BACKLOG = 600
OUTAGE_S = 5.0


def test_a_database_outage_mid_run_loses_nothing_and_records_nothing_twice(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack = make_stack(
        proxy_db=True,  # the API and the workers reach PostgreSQL through the proxy
        **DATABASE_FAULT_ENV,
    )
    proxy = stack.proxy
    assert proxy is not None
    busy = run_up_to_the_fault(stack, BACKLOG)
    submission, workers = busy.steady.submission, busy.workers
    unfinished = len(submission.ids) - stack.terminal_count()
    proxy.cut()
    cut_at = time.monotonic()
    time.sleep(OUTAGE_S)  # the fault itself: the database stays unreachable this long
    proxy.restore()
    outage_s = time.monotonic() - cut_at
    busy.steady.stop_once_accepted_again()

    accounting = stack.account("database down 5 s", submission, busy.started, 120, record)
    details = accounting.figures.details
    details["unfinished_at_fault"] = unfinished
    details["outage_s"] = round(outage_s, 1)
    details["done_before_outage"] = busy.done_before
    details["submitting_at_fault"] = busy.still_submitting
    details["connections_severed"] = proxy.severed
    details["reenqueued"] = stack.reenqueued(busy.celery_worker)
    stack.assert_nothing_lost(accounting)
    # A worker that waits for the database keeps its batch: nothing is computed twice.
    stack.assert_computed_once(accounting)
    rows = accounting.rows.values()
    assert {r.status for r in rows} == {"succeeded"}, details
    assert all(worker.alive() and worker.starts == 1 for worker in workers)
    # The outage was real: connections were cut and clients were turned away.
    assert proxy.severed > 0, details
    assert busy.still_submitting and details["retried"], details
    assert stack.procs["api"].alive()
    details["worker_retries"] = retries = stack.write_retries(workers)
    assert all(retries.values()), f"the outage missed a worker: {retries}"
