"""The PostgreSQL server stopped (pg_ctl stop -m fast) mid-run and started again seconds later.

Not a connection cut (test_database_outage.py): the server itself ends every
session, refuses connections while it is down, and comes back with what it
had committed. The test owns the server (``initdb``, harness.postgres).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack
from harness.postgres import PostgresServers, create_database
from tests.faults.database_down import DATABASE_FAULT_ENV, ServerOutage, run_up_to_the_fault

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
    # Every session ended, batches in flight; the stop returns once the server is down.
    outage = ServerOutage(stack, busy, stop=lambda: server.stop("fast"))
    outage.restore(server.start, after_s=DOWN_S)

    details = outage.assert_waited_out(
        "PostgreSQL stopped 4 s", record, moment="stop", length="down_s"
    )
    # The stop was felt by the workers too: they waited.
    assert any(details["worker_retries"].values()), f"no worker met the stopped server: {details}"
