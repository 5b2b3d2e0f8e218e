"""The PostgreSQL primary killed mid-run and its synchronous streaming replica promoted.

Ferry's processes are given one URL naming both servers with
``target_session_attrs=read-write`` (``harness.postgres.failover_url``): libpq
passes over the dead primary and over the replica while it is a standby, so
the processes wait as through an outage, then reach the promoted replica with
no restart and no change of configuration. The replica is synchronous: a
commit the primary acknowledged is on the replica, so nothing an answer or a
worker relied on is lost with the primary.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack
from harness.postgres import PostgresServers, create_database, failover_url
from tests.faults.database_down import (
    DATABASE_FAULT_ENV,
    assert_unavailable,
    run_up_to_the_fault,
    wait_ready,
)

pytestmark = pytest.mark.faults

BACKLOG = 400
# How long the replica stays a standby after the primary died: an operator's
# (or a failover manager's) time to decide.
PROMOTE_AFTER_S = 3.0


def test_a_failover_to_a_synchronous_replica_mid_run_loses_nothing_and_records_nothing_twice(
    postgres: PostgresServers,
    make_stack: Callable[..., Stack],
    record: Callable[[Figures], None],
) -> None:
    primary = postgres.primary()
    create_database(primary, "ferry")
    replica = postgres.replica(primary, synchronous=True)
    stack = make_stack(url=failover_url("ferry", primary, replica), **DATABASE_FAULT_ENV)
    busy = run_up_to_the_fault(stack, BACKLOG)
    submission, workers = busy.steady.submission, busy.workers
    # The primary dies as a crash leaves it (no checkpoint, sessions cut) and stays dead.
    killed_at = time.monotonic()
    primary.stop("immediate")
    # The replica is up but read-only: the processes reach no server that takes writes.
    answers = assert_unavailable(stack, submission.accepted[0])
    time.sleep(max(0.0, PROMOTE_AFTER_S - (time.monotonic() - killed_at)))
    replica.promote()
    gap_s = time.monotonic() - killed_at
    wait_ready(stack)
    busy.steady.stop_once_accepted_again()

    accounting = stack.account("PostgreSQL failed over", submission, busy.started, 120, record)
    details = accounting.figures.details
    details["gap_s"] = round(gap_s, 1)
    details["done_before_kill"] = busy.done_before
    details["submitting_at_kill"] = busy.still_submitting
    details["answers_while_down"] = answers
    details["reenqueued"] = stack.reenqueued(busy.celery_worker)
    details["worker_retries"] = retries = stack.write_retries(workers)
    # Everything was read from the promoted replica, the old primary being down.
    assert not primary.running()
    assert replica.query("SELECT pg_is_in_recovery()") == [(False,)]
    stack.assert_nothing_lost(accounting)
    stack.assert_computed_once(accounting)
    assert {r.status for r in accounting.rows.values()} == {"succeeded"}, details
    assert all(worker.alive() and worker.starts == 1 for worker in workers), details
    assert stack.procs["api"].alive()
    assert busy.still_submitting and details["retried"], details
    assert any(retries.values()), f"no worker met the failover: {details}"
