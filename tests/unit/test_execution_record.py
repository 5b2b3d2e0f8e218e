"""The execution record and what the fault suite counts from it: computed twice shows."""

from __future__ import annotations

import os
from pathlib import Path

from harness.accounting import RECORDING_DEPTH, count_executions
from workers.gpu.executions import Execution, ExecutionLog, read_executions


def batch(worker: str, pid: int, seq: int, *jobs: tuple[str, int]) -> Execution:
    return Execution(worker, pid, seq, f"{worker}-{seq}", jobs)


def test_each_batch_is_a_line_of_its_own_process_file_read_back_in_order(tmp_path: Path) -> None:
    log = ExecutionLog(tmp_path / "executions", "host:sim:cpu#0")
    log.append("b1", [("j1", 1), ("j2", 1)])
    log.close()
    log.append("b2", [("j3", 2)])  # after close(): opened again, appended
    log.close()
    assert log.path.name == f"host_sim_cpu_0.{os.getpid()}.jsonl"
    assert read_executions(tmp_path / "executions") == [
        Execution("host:sim:cpu#0", os.getpid(), 1, "b1", (("j1", 1), ("j2", 1))),
        Execution("host:sim:cpu#0", os.getpid(), 2, "b2", (("j3", 2),)),
    ]


def test_a_line_cut_short_by_a_kill_is_not_an_execution(tmp_path: Path) -> None:
    log = ExecutionLog(tmp_path, "w1")
    log.append("b1", [("j1", 1)])
    log.close()
    with log.path.open("a") as file:
        file.write('{"worker":"w1","pid":1,"seq":2,"batch":"b2","jobs":[["j2",')
    assert [e.jobs for e in read_executions(tmp_path)] == [(("j1", 1),)]


def test_a_job_computed_by_two_live_workers_is_run_twice() -> None:
    # The stale worker's result was refused by the conditional write: one
    # result, one announcement; the record still has both computations.
    records = [batch("w1", 10, 1, ("a", 1), ("b", 1)), batch("w2", 20, 1, ("a", 2))]
    counted = count_executions(records, died=set())
    assert counted.per_job == {"a": 2, "b": 1}
    assert counted.run_twice == {"a": 1}
    assert not counted.after_crash
    assert counted.total == 3


def test_a_job_computed_again_after_its_worker_died_before_writing_it_is_explained() -> None:
    records = [
        batch("w1", 10, 1, ("a", 1)),
        batch("w1", 10, 2, ("b", 1)),
        batch("w1", 10, 3, ("c", 1)),  # the last two: computed, maybe not written
        batch("w2", 20, 1, ("b", 2), ("c", 2)),
    ]
    counted = count_executions(records, died={10})
    assert counted.after_crash == {"b": 1, "c": 1}
    assert not counted.run_twice
    assert RECORDING_DEPTH == 2


def test_a_dead_workers_older_batch_computed_again_is_not_explained_by_its_death() -> None:
    # Batch 1 was followed by two more: it had been written when w1 died.
    records = [
        batch("w1", 10, 1, ("a", 1)),
        batch("w1", 10, 2, ("b", 1)),
        batch("w1", 10, 3, ("c", 1)),
        batch("w2", 20, 1, ("a", 2)),
    ]
    counted = count_executions(records, died={10})
    assert counted.run_twice == {"a": 1}
    assert not counted.after_crash


def test_loops_sharing_a_process_number_their_batches_apart() -> None:
    records = [
        batch("w1", 10, 1, ("a", 1)),
        *(batch("w2", 10, seq, (f"x{seq}", 1)) for seq in range(1, 6)),
        batch("w3", 20, 1, ("a", 2)),
    ]
    # w1's only batch is its last, whatever w2 did in the same process.
    assert count_executions(records, died={10}).after_crash == {"a": 1}
