"""Redis killed and restarted empty mid-run: the reconciler re-enqueues what it lost."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack, sim_batches, sim_jobs
from harness.processes import wait_for

pytestmark = pytest.mark.faults

JOBS = 1500
BACKLOG = 600
DOWN_S = 1.0


def test_redis_restarted_without_its_data_loses_no_accepted_job(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack = make_stack(
        FERRY_RECONCILE_INTERVAL_S="1",
        FERRY_RECONCILE_GRACE_S="2",
        FERRY_VISIBILITY_TIMEOUT_S="10",
        **sim_batches(50, 5, max_size=32),  # a batch of 32 takes about half a second
    )
    stack.start_api()
    # Supervised, as `ferry up` and the Compose file run them (restarted when
    # they exit); the API and the sim workers are not, and must stay up.
    celery_worker = stack.spawn("celery-worker", ["celery", "worker"], supervised=True)
    beat = stack.spawn("celery-beat", ["celery", "beat"], supervised=True)
    started = time.monotonic()
    submission, submitted = stack.submit_in_background(sim_jobs(JOBS))
    # A backlog first, so that both workers are busy when the fault strikes.
    wait_for("a backlog", lambda: len(submission.ids) >= BACKLOG, 60)
    workers = stack.start_workers("w1", "w2")

    wait_for("a few hundred jobs to finish", lambda: stack.terminal_count() >= 300, 60, 0.1)
    done_before = stack.terminal_count()
    queued_before = stack.stream_entries()
    subscriptions = stack.listener.subscriptions
    unfinished = len(submission.ids) - stack.terminal_count()
    stack.kill_redis(wipe=True)
    time.sleep(DOWN_S)  # the fault itself: Redis stays down this long
    stack.start_redis()  # same port, empty
    # Count what is published from now on, as before.
    stack.listener.wait_subscribed(subscriptions)
    submitted.result(timeout=120)

    accounting = stack.account("Redis restarted empty", submission, started, 60, record)
    details = accounting.figures.details
    details["unfinished_at_fault"] = unfinished
    details["done_before_restart"] = done_before
    details["stream_entries_lost"] = queued_before
    details["reenqueued"] = stack.reenqueued(celery_worker)
    stack.assert_nothing_lost(accounting)
    # Re-enqueued entries are of jobs not computed yet: nothing is computed twice.
    stack.assert_computed_once(accounting)
    rows = accounting.rows.values()
    assert {r.status for r in rows} == {"succeeded"}, details
    assert queued_before > 0, "nothing was queued when Redis went: the test tests nothing"
    assert details["reenqueued"] > 0, details
    assert all(p.alive() and p.starts == 1 for p in [*workers, stack.procs["api"]])
    assert celery_worker.alive() and beat.alive()
