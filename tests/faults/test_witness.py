"""The witnesses see what the worker would not: a second terminal write, a second computation.

After a clean run, a job is made terminal again by an UPDATE straight to the
database (no conditional write, nothing announced), another is rewritten with
its own status, and a job is computed again by the sim in a live process
(the test's). The accounting, counted from the transition log and the sim's
record alone, reports each one, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from sqlalchemy import update

from backends.sim import SimRuntime
from core.db.schema import Job
from harness.accounting import Figures
from harness.faults import Stack, sim_jobs

pytestmark = pytest.mark.faults

JOBS = 60


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_the_witnesses_count_a_double_write_and_a_second_computation(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None], database: str
) -> None:
    stack = make_stack(database=database, FERRY_SIM_LATENCY_BASE_MS="5")
    stack.start("w1")
    started = time.monotonic()
    submission = stack.submit(sim_jobs(JOBS))
    clean = stack.account(f"witnessed run ({database})", submission, started, 60, record)
    stack.assert_nothing_lost(clean)
    stack.assert_computed_once(clean)
    f = clean.figures
    assert f.submitted == f.completed == JOBS and f.written_twice == 0, f
    # Each job: inserted queued, then running, then succeeded, by the log.
    for job_id in submission.accepted:
        assert [t.new_status for t in clean.transitions[job_id]][-1] == "succeeded"
        assert clean.transitions[job_id][0].old_status is None
    # Each stored output names the one computation witnessed for its job.
    for job_id, row in clean.rows.items():
        assert [row.output["nonce"]] == clean.executions.nonces[job_id], f

    rewritten, refailed, recomputed = submission.accepted[:3]
    with stack.engine.begin() as conn:
        conn.execute(
            update(Job).where(Job.id == rewritten)
            .values(status="succeeded", output={"cost": 1, "nonce": "not-computed"})
        )  # fmt: skip
    again = stack.account("injected", submission, started, 10, lambda _figures: None)
    assert again.figures.written_twice == 1, again.figures
    assert again.figures.details["written_twice_ids"] == [rewritten]
    assert again.figures.details["succeeded_unexecuted"] == [rewritten]
    assert again.figures.lost == 0 and again.figures.run_twice == 0
    # Nothing was announced: the worker's own signal would have seen nothing.
    assert again.figures.details["announced_twice"] == 0

    with stack.engine.begin() as conn:
        conn.execute(update(Job).where(Job.id == refailed).values(status="failed", error="x"))
    sim = SimRuntime(0.0, 0.0, 0, 0, witness_dir=stack.witness_dir)
    (output,) = sim.run([again.rows[recomputed].input])
    again = stack.account("injected", submission, started, 10, lambda _figures: None)
    figures = again.figures
    assert figures.written_twice == 2, figures
    assert figures.details["written_twice_ids"] == sorted([rewritten, refailed])
    assert figures.run_twice == 1 and figures.after_crash == 0, figures
    assert figures.details["run_twice_ids"] == [recomputed]
    assert figures.executions == JOBS + 1
    assert again.executions.nonces[recomputed][-1] == output["nonce"]
    assert again.executions.nonces[recomputed][0] == again.rows[recomputed].output["nonce"]
    # The worker's record saw neither.
    assert figures.details["record_run_twice"] == 0
