"""A bad input and an oversized batch: only the bad input fails, nobody fails for memory."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness.accounting import Figures
from harness.faults import MODEL, Stack, sim_jobs, without_nonce

pytestmark = pytest.mark.faults


def test_a_poison_input_fails_alone_and_the_rest_of_its_batch_succeeds(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    stack = make_stack(FERRY_SIM_LATENCY_BASE_MS="20", FERRY_BATCH_MAX_SIZE="32")
    stack.start_api()
    bodies = sim_jobs(96)
    poison_at = 40
    bodies[poison_at] = {"model": MODEL, "input": {"cost": 1, "fail": True}}
    started = time.monotonic()
    # Queued before any worker runs, so the poison input shares a full batch.
    submission = stack.submit(bodies)
    stack.start_worker("w1")
    accounting = stack.account("poison input", submission, started, 60, record)
    stack.assert_nothing_lost(accounting)
    stack.assert_computed_once(accounting)

    rows = accounting.rows
    poison = rows[submission.ids[poison_at]]
    assert poison.status == "failed", poison
    assert poison.error is not None and "SimulatedFailure: simulated failure" in poison.error
    assert poison.attempts == 1
    assert poison.batch_size is not None and poison.batch_size > 1, "it ran alone: no test"
    others = [(i, rows[job_id]) for i, job_id in submission.ids.items() if i != poison_at]
    assert {row.status for _, row in others} == {"succeeded"}, accounting.figures.details
    assert all(
        without_nonce(row.output) == {"cost": bodies[i]["input"]["cost"]} for i, row in others
    )
    assert all(row.attempts == 1 for _, row in others)
    # Its batch mates were recorded with it, in the same batch.
    assert sum(1 for _, row in others if row.batch_size == poison.batch_size) > 0


def test_simulated_out_of_memory_splits_batches_and_fails_nobody(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None]
) -> None:
    # 64 MiB + 1 MiB per unit of cost (the defaults); the device holds 104 MiB,
    # so a full batch of 32 jobs of cost 4 (192 MiB) does not fit, 8 of them do.
    capacity = 64 * 2**20 + 40 * 2**20
    stack = make_stack(
        FERRY_SIM_LATENCY_BASE_MS="10",
        FERRY_BATCH_MAX_SIZE="32",
        FERRY_SIM_MEMORY_CAPACITY_BYTES=str(capacity),
    )
    stack.start_api()
    bodies = sim_jobs(256, costs=(4,))
    started = time.monotonic()
    submission = stack.submit(bodies)
    worker = stack.start_worker("w1")
    accounting = stack.account("out of memory", submission, started, 60, record)
    stack.assert_nothing_lost(accounting)
    stack.assert_computed_once(accounting)

    rows = accounting.rows.values()
    assert {row.status for row in rows} == {"succeeded"}, accounting.figures.details
    assert all(without_nonce(row.output) == {"cost": 4} and row.attempts == 1 for row in rows)
    logs = stack.log_lines(worker)
    ooms = [r for r in logs if r["msg"] == "out of memory; memory ceiling lowered"]
    batches = [r for r in logs if r["msg"] == "batch done"]
    assert ooms, "no batch ran out of memory: the test tests nothing"
    assert all(r["memory_ceiling_bytes"] < 32 * 4 * 2**20 + 64 * 2**20 for r in ooms)
    # It learned: most batches were cut to fit rather than split after failing.
    assert len(batches) > len(ooms), (len(batches), len(ooms))
    accounting.figures.details["oom_events"] = len(ooms)
    accounting.figures.details["batches"] = len(batches)
