"""The PostgreSQL server stopped (pg_ctl stop -m fast) mid-run and started again seconds later.

Not a connection cut (test_database_outage.py): the server itself ends every
session, refuses connections while it is down, and comes back with what it
had committed. The test owns the server (``initdb``, harness.postgres).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack
from harness.postgres import PostgresServers, create_database
from tests.faults.database_down import (
    DATABASE_FAULT_ENV,
    assert_unavailable,
    run_up_to_the_fault,
    wait_ready,
)

pytestmark = pytest.mark.faults

BACKLOG = 400
DOWN_S = 4.0


def test_postgres_stopped_and_restarted_mid_run_loses_nothing_and_records_nothing_twice(
    postgres: PostgresServers,
    make_stack: Callable[..., Stack],
    record: Callable[[Figures], None],
) -> None:
    server = postgres.primary()
    stack = make_stack(url=create_database(server, "ferry"), **DATABASE_FAULT_ENV)
    busy = run_up_to_the_fault(stack, BACKLOG)
    submission, workers = busy.steady.submission, busy.workers
    stopped_at = time.monotonic()
    server.stop("fast")  # every session ended, batches in flight; returns once it is down
    answers = assert_unavailable(stack, submission.accepted[0])
    time.sleep(max(0.0, DOWN_S - (time.monotonic() - stopped_at)))
    server.start()
    down_s = time.monotonic() - stopped_at
    wait_ready(stack)
    busy.steady.stop_once_accepted_again()

    accounting = stack.account("PostgreSQL stopped 4 s", submission, busy.started, 120, record)
    details = accounting.figures.details
    details["down_s"] = round(down_s, 1)
    details["done_before_stop"] = busy.done_before
    details["submitting_at_stop"] = busy.still_submitting
    details["answers_while_down"] = answers
    details["reenqueued"] = stack.reenqueued(busy.celery_worker)
    details["worker_retries"] = retries = stack.write_retries(workers)
    stack.assert_nothing_lost(accounting)
    # No process died: a worker that waits for the database keeps its batch, so
    # nothing is computed twice.
    stack.assert_computed_once(accounting)
    assert {r.status for r in accounting.rows.values()} == {"succeeded"}, details
    assert all(worker.alive() and worker.starts == 1 for worker in workers), details
    assert stack.procs["api"].alive()
    # The stop was felt: clients were turned away while it lasted, and workers waited.
    assert busy.still_submitting and details["retried"], details
    assert any(retries.values()), f"no worker met the stopped server: {details}"
