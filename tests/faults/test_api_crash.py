"""An API process SIGKILLed under load between its database commit and its enqueue.

The rows of the group it was writing are committed and their stream entries
never written; the clients of that group lost their answers. Each retries
with its idempotency key (as a careful client does) and the restarted API
answers with the job it had committed (a replay, not a second job); the
reconciler finds the committed jobs with no stream entry past its grace and
enqueues them, and each runs once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import enqueue_crash
from harness.accounting import Figures
from harness.faults import Stack, sim_batches, sim_jobs
from harness.processes import wait_for

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
JOBS = 900
BACKLOG = 200


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
def test_an_api_killed_between_commit_and_enqueue_loses_nothing_and_doubles_nothing(
    make_stack: Callable[..., Stack],
    record: Callable[[Figures], None],
    tmp_path: Path,
    database: str,
) -> None:
    trigger = tmp_path / "crash-before-enqueue"
    stack = make_stack(
        database=database,
        FERRY_RECONCILE_INTERVAL_S="1",
        FERRY_RECONCILE_GRACE_S="2",
        **sim_batches(20, 2, max_size=32),
    )
    site = enqueue_crash.sitecustomize_dir(tmp_path, ROOT)
    python_path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    # Supervised, as `ferry up` and Compose run it: restarted once it is killed.
    api = stack.spawn(
        "api", ["api"], True, PYTHONPATH=python_path, **{enqueue_crash.ENV: str(trigger)}
    )
    celery_worker = stack.spawn("celery-worker", ["celery", "worker"], supervised=True)
    stack.spawn("celery-beat", ["celery", "beat"], supervised=True)
    workers = stack.start_workers("w1")
    stack.wait_api(api)
    started = time.monotonic()
    submission, submitted = stack.submit_in_background(sim_jobs(JOBS), threads=8)
    wait_for("a backlog", lambda: len(submission.ids) >= BACKLOG, 60)
    trigger.touch()  # the next group the API writes is its last
    wait_for(
        "the API to die between commit and enqueue",
        lambda: enqueue_crash.committed_ids(trigger) is not None,
        30,
        0.05,
    )
    stranded = enqueue_crash.committed_ids(trigger)
    assert stranded, "the killed group committed no job: the test tests nothing"
    # The restarted API answers the retries; the submissions go on to the end.
    wait_for("the API back", lambda: api.starts == 2 and api.alive(), 60)
    stack.wait_api(api)
    submitted.result(timeout=180)

    accounting = stack.account(f"API killed before enqueue ({database})", submission,
                               started, 90, record)  # fmt: skip
    details = accounting.figures.details
    details["stranded"] = len(stranded)
    details["replayed"] = len(submission.replayed)
    details["reenqueued"] = stack.reenqueued(celery_worker)
    stack.assert_nothing_lost(accounting)
    stack.assert_computed_once(accounting)
    # Every stranded job was answered at last (its client's retry found it: the
    # submission's ids hold it once) and ran once, from the reconciler's entry.
    assert set(stranded) <= set(submission.accepted), details
    assert len(set(submission.accepted)) == JOBS == stack.row_count(), details
    assert {accounting.rows[i].status for i in stranded} == {"succeeded"}, details
    assert all(accounting.executions.per_job[i] == 1 for i in stranded), details
    assert details["replayed"] >= 1, details
    assert details["reenqueued"] >= len(stranded), details
    assert api.starts == 2, "the API was killed more than once"
    assert all(w.alive() and w.starts == 1 for w in workers)
