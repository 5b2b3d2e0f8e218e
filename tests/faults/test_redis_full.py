"""Redis at its maxmemory under a flood (noeviction, as Ferry runs it), its worker stalled: the API
refuses new jobs with a 503 and a Retry-After and drops nothing it accepted; once the worker goes
on, its acknowledgements free memory and the API takes jobs again by itself."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import Stack, sim_batches, sim_jobs
from harness.processes import wait_for

pytestmark = pytest.mark.faults

JOBS = 4000
# Redis's own memory grows by some hundreds of KB with its first thousands of script calls,
# then holds: maxmemory is set once this many jobs have run, at what it uses then plus room
# for some hundreds of stream entries more, which the flood fills while the worker is
# stopped.
WARM_JOBS = 500
HEADROOM_BYTES = 128 * 1024
# The flood is paced, so that most of it is still to come once maxmemory is set: sent all
# at once, the API had taken about 3,800 of the 4,000 by then, and whether the rest
# filled the room (a refusal ever came) depended on Redis's other memory.
FLOOD_PER_S = 400


def test_redis_at_maxmemory_refuses_new_jobs_and_loses_none(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack = make_stack(**sim_batches(50, 0.5, max_size=32))  # batches of about 100 ms
    # No Celery: it has no part in a job's path, and its worker exits at start while
    # its broker (this Redis) refuses writes (`ferry up` restarts it, with a backoff).
    (worker,) = stack.start("w1")
    started = time.monotonic()
    submission, submitted = stack.submit_in_background(
        sim_jobs(JOBS), threads=8, retry_s=300, rate_per_s=FLOOD_PER_S
    )
    wait_for("the first jobs to run", lambda: stack.terminal_count() >= WARM_JOBS, 120, 0.1)
    assert not submission.retried["503"]
    maxmemory = int(stack.redis.info("memory")["used_memory"]) + HEADROOM_BYTES
    stack.redis.config_set("maxmemory", maxmemory)
    stack.signal(worker, signal.SIGSTOP)
    wait_for("the API to refuse", lambda: submission.retried["503"] > 0, 120, 0.1)
    full_at = len(submission.ids)
    # Full a while: what the API takes now is only what Redis still queues (a few, as its
    # other memory comes and goes); with no reconciler running, a job accepted and not
    # queued would never run, and would count as lost.
    time.sleep(3)
    stack.signal(worker, signal.SIGCONT)
    submitted.result(timeout=300)
    accounting = stack.account("Redis at maxmemory", submission, started, 120, record)
    details = accounting.figures.details
    details["accepted_when_first_full"] = full_at
    details["refusals"] = {
        f"{kind}, Retry-After {wait}": count
        for (kind, wait), count in submission.unavailable.items()
    }
    stack.assert_nothing_lost(accounting)
    stack.assert_computed_once(accounting)
    rows = accounting.rows.values()
    # Refused while full, every job was taken once the worker had freed room.
    assert 0 < full_at < JOBS, details
    assert len(submission.ids) == JOBS, details
    assert {r.status for r in rows} == {"succeeded"}, details
    # Every refusal said when to come back, and said why.
    assert all(kind == "queue_full" and wait.isdigit() and int(wait) >= 1
               for kind, wait in submission.unavailable), details  # fmt: skip
    assert all(p.alive() and p.starts == 1 for p in [worker, stack.procs["api"]])
    assert int(stack.redis.info("memory")["used_memory"]) < maxmemory
