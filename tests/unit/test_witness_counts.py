"""The sim's computation witness and what the fault suite counts from the witnesses."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from backends.sim import SimRuntime, Witnessed, read_witness
from harness.accounting import RECORDING_DEPTH, count_computations, tally
from harness.submitting import Submission
from harness.witness import Transition


def sim(witness_dir: Path | None) -> SimRuntime:
    return SimRuntime(0.0, 0.0, 0, 0, witness_dir=witness_dir, sleep=lambda _s: None)


def test_without_a_witness_dir_outputs_are_the_model_s_alone(tmp_path: Path) -> None:
    assert sim(None).run([{"cost": 2, "tag": "a"}]) == [{"cost": 2}]
    assert list(tmp_path.iterdir()) == []


def test_each_computation_gets_a_fresh_nonce_and_a_line_of_its_process(tmp_path: Path) -> None:
    runtime = sim(tmp_path / "w")
    first = runtime.run([{"cost": 1, "tag": "a"}, {"cost": 2, "tag": "b"}])
    again = runtime.run([{"cost": 1, "tag": "a"}, {"cost": 3}])
    assert [o["cost"] for o in first + again] == [1, 2, 1, 3]
    nonces = [o["nonce"] for o in first + again]
    assert len(set(nonces)) == 4 and all(len(n) == 16 for n in nonces)
    witnessed = read_witness(tmp_path / "w")
    assert [(w.pid, w.seq) for w in witnessed] == [(os.getpid(), 1), (os.getpid(), 2)]
    assert [w.items for w in witnessed] == [
        (("a", nonces[0]), ("b", nonces[1])),
        (("a", nonces[2]), (None, nonces[3])),
    ]


def test_a_line_cut_short_by_a_kill_is_not_a_computation(tmp_path: Path) -> None:
    sim(tmp_path).run([{"cost": 1, "tag": "a"}])
    (path,) = tmp_path.iterdir()
    with path.open("a") as file:
        file.write('{"pid":1,"seq":2,"at":1.0,"items":[["b",')
    assert [w.items[0][0] for w in read_witness(tmp_path)] == ["a"]


def batch(pid: int, seq: int, *items: tuple[str | None, str]) -> Witnessed:
    return Witnessed(pid, seq, float(seq + pid), items)


TAGS = {"ta": "a", "tb": "b", "tc": "c"}


def test_a_job_computed_twice_by_live_processes_is_run_twice() -> None:
    counted = count_computations(
        [batch(10, 1, ("ta", "n1"), ("tb", "n2")), batch(20, 1, ("ta", "n3"))], TAGS, died=set()
    )
    assert counted.per_job == {"a": 2, "b": 1}
    assert counted.run_twice == {"a": 1} and not counted.after_crash
    assert counted.nonces == {"a": ["n1", "n3"], "b": ["n2"]}


def test_a_dead_process_s_last_batches_explain_a_repeat_and_older_ones_do_not() -> None:
    dead = [batch(10, seq, (tag, f"n{seq}")) for seq, tag in enumerate(["ta", "tb", "tc"], 1)]
    assert RECORDING_DEPTH == 2  # the last two of pid 10: b and c
    again = [batch(20, seq, (tag, f"m{seq}")) for seq, tag in enumerate(["ta", "tb", "tc"], 1)]
    counted = count_computations(dead + again, TAGS, died={10})
    assert counted.after_crash == {"b": 1, "c": 1}
    assert counted.run_twice == {"a": 1}


def test_untagged_outputs_are_counted_and_other_jobs_tags_ignored() -> None:
    counted = count_computations([batch(10, 1, (None, "n1"), ("tz", "n2"))], TAGS, died=set())
    assert counted.untagged == 1 and not counted.per_job


def row(status: str, nonce: str | None = None) -> Any:
    return SimpleNamespace(status=status, attempts=1, output={"cost": 1, "nonce": nonce})


def moves(job_id: str, *statuses: str) -> list[Transition]:
    chain = [None, *statuses]
    return [Transition(job_id, old, new, "") for old, new in zip(chain, statuses, strict=False)]


def test_tally_counts_lost_and_written_twice_from_the_transitions() -> None:
    submission = Submission(ids={0: "a", 1: "b", 2: "c"})
    computations = count_computations(
        [batch(10, 1, ("ta", "n1"), ("tb", "n2"), ("tc", "n3"))], TAGS, died=set()
    )
    figures = tally(
        "s", submission,
        # c's row says succeeded, but no terminal write of it was logged.
        {"a": row("succeeded", "n1"), "b": row("succeeded", "forged"), "c": row("succeeded", "n3")},
        {"a": moves("a", "queued", "running", "succeeded", "succeeded"),
         "b": moves("b", "queued", "running", "succeeded"), "c": moves("c", "queued", "running")},
        computations, 1.0, 3,
    )  # fmt: skip
    assert (figures.submitted, figures.completed, figures.lost) == (3, 2, 1)
    assert figures.written_twice == 1 and figures.details["written_twice_ids"] == ["a"]
    assert figures.details["lost_ids"] == ["c"]
    assert figures.details["terminal_untracked"] == ["c"]
    assert figures.details["succeeded_unexecuted"] == ["b"]  # not the nonce it computed
    assert figures.executions == 3 and figures.run_twice == 0
