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

from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack
from harness.postgres import PostgresServers, create_database, failover_url
from tests.faults.database_down import DATABASE_FAULT_ENV, ServerOutage, run_up_to_the_fault

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
    # The primary dies as a crash leaves it (no checkpoint, sessions cut) and stays dead. The
    # replica is up but read-only: the processes reach no server that takes writes.
    outage = ServerOutage(stack, busy, stop=lambda: primary.stop("immediate"))
    outage.restore(replica.promote, after_s=PROMOTE_AFTER_S)

    details = outage.assert_waited_out(
        "PostgreSQL failed over", record, moment="kill", length="gap_s"
    )
    # Everything was read from the promoted replica, the old primary being down.
    assert not primary.running()
    assert replica.query("SELECT pg_is_in_recovery()") == [(False,)]
    assert any(details["worker_retries"].values()), f"no worker met the failover: {details}"
