"""What a scenario submitted, completed, lost, ran and wrote twice, counted from its witnesses.

The figures come from records the code under test does not keep
(``harness.witness``): the database's transition log, filled by a trigger the
harness installs, and the sim model's record of its computations.

Submitted: the jobs a 202 answered for. Completed: those with a transition
into a terminal status; lost: the others. Written twice: jobs with more than
one transition into a terminal status, whoever wrote them. Executions: the
computations of the submitted jobs, one nonce each, by the sim's record. A
job computed more than once was either re-run after a crash (its first
computation's process died before writing it) or run twice, which nothing
excuses: the conditional write kept one result, but the work was done twice.

The worker's own execution record (``workers.gpu.executions``) and its
done-channel announcements (``harness.listener``) are kept in the details as
a cross-check.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from backends.sim import Witnessed
from core.db.schema import TERMINAL_STATUSES
from harness.submitting import Submission
from harness.witness import Transition, terminal_writes
from workers.gpu.executions import Execution

# The batches a worker can have computed but not yet written when it dies: the
# one on the recording thread and the one waiting to be handed over to it
# (workers.gpu.recording.Recording.hand_over). Only those may run again.
RECORDING_DEPTH = 2


@dataclass
class Executions:
    """How many times each job was computed, and which repeats a dead worker explains."""

    per_job: Counter[str]
    # Computations followed by another that a worker's death explains: they were
    # among the last batches of a process that died before it could write them.
    after_crash: Counter[str]
    # Computations followed by another that nothing explains: computed twice.
    run_twice: Counter[str]

    @property
    def total(self) -> int:
        return sum(self.per_job.values())


def count_executions(records: Iterable[Execution], died: set[int]) -> Executions:
    """Count the record's executions; ``died``: the pids of workers that died (kill -9, crash).

    Each computation of a job but its last needs a reason to have been
    repeated: that its process died with it among its last ``RECORDING_DEPTH``
    batches, before its outcome could be written.
    """
    # A loop numbers its batches: (worker, pid) tells loops sharing a process apart.
    last_seq: dict[tuple[str, int], int] = {}
    runs: dict[str, list[tuple[int, str, int, int]]] = defaultdict(list)
    for execution in records:
        loop = (execution.worker, execution.pid)
        last_seq[loop] = max(last_seq.get(loop, 0), execution.seq)
        for job_id, attempt in execution.jobs:
            runs[job_id].append((attempt, execution.worker, execution.pid, execution.seq))
    per_job: Counter[str] = Counter({job_id: len(seen) for job_id, seen in runs.items()})
    after_crash: Counter[str] = Counter()
    run_twice: Counter[str] = Counter()
    for job_id, seen in runs.items():
        # In the order of their claims; the last needs no reason.
        for _attempt, worker, pid, seq in sorted(seen)[:-1]:
            if pid in died and seq > last_seq[(worker, pid)] - RECORDING_DEPTH:
                after_crash[job_id] += 1
            else:
                run_twice[job_id] += 1
    return Executions(per_job, after_crash, run_twice)


@dataclass
class Computations(Executions):
    """The sim's witnessed computations of each job (by its tag), with their nonces."""

    nonces: dict[str, list[str]] = field(default_factory=dict)
    untagged: int = 0  # computed outputs whose input had no tag: no job can be named


def count_computations(
    witnessed: Iterable[Witnessed], job_of_tag: dict[str, str], died: set[int]
) -> Computations:
    """Count the sim's computations per job; ``died``: the pids of workers that died.

    As :func:`count_executions`, each computation of a job but its last needs
    a reason: that its process died with it among the last ``RECORDING_DEPTH``
    batches it computed (those can be computed and not yet written).
    """
    last_seq: dict[int, int] = {}
    runs: dict[str, list[tuple[float, int, int, str]]] = defaultdict(list)
    untagged = 0
    for batch in witnessed:
        last_seq[batch.pid] = max(last_seq.get(batch.pid, 0), batch.seq)
        for tag, nonce in batch.items:
            if tag is None:
                untagged += 1
            elif tag in job_of_tag:  # others are jobs this count is not about
                runs[job_of_tag[tag]].append((batch.at, batch.pid, batch.seq, nonce))
    per_job: Counter[str] = Counter({job_id: len(seen) for job_id, seen in runs.items()})
    after_crash: Counter[str] = Counter()
    run_twice: Counter[str] = Counter()
    for job_id, seen in runs.items():
        for _at, pid, seq, _nonce in sorted(seen)[:-1]:  # in the order computed
            if pid in died and seq > last_seq[pid] - RECORDING_DEPTH:
                after_crash[job_id] += 1
            else:
                run_twice[job_id] += 1
    nonces = {job_id: [nonce for *_, nonce in sorted(seen)] for job_id, seen in runs.items()}
    return Computations(per_job, after_crash, run_twice, nonces, untagged)


@dataclass
class Figures:
    scenario: str
    submitted: int
    completed: int
    lost: int
    executions: int  # computations of the submitted jobs, witnessed by the sim
    after_crash: int  # re-runs a dead worker explains
    run_twice: int  # re-runs nothing explains (must be 0)
    written_twice: int  # jobs made terminal more than once, by the transition log (must be 0)
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)

    def row(self) -> str:
        return (
            f"{self.scenario:<28} | {self.submitted:>9} | {self.completed:>9} | "
            f"{self.lost:>4} | {self.executions:>10} | {self.after_crash:>11} | "
            f"{self.run_twice:>9} | {self.written_twice:>13} | {self.seconds:>7.1f}"
        )


HEADER = (
    f"{'scenario':<28} | {'submitted':>9} | {'completed':>9} | "
    f"{'lost':>4} | {'executions':>10} | {'after crash':>11} | "
    f"{'run twice':>9} | {'written twice':>13} | {'seconds':>7}"
)
FIGURES: list[Figures] = []


@dataclass
class Accounting:
    figures: Figures
    rows: dict[str, Any]  # job id -> row (id, status, attempts, error, output, ...)
    published: Counter[str]  # the done channel's announcements (a cross-check)
    executions: Computations  # the sim's witnessed computations
    record: Executions  # the worker's own execution record (a cross-check)
    transitions: dict[str, list[Transition]]


def tally(
    scenario: str,
    submission: Submission,
    rows: dict[str, Any],
    transitions: dict[str, list[Transition]],
    computations: Computations,
    seconds: float,
    max_attempts: int,
    published: Counter[str] | None = None,
    record: Executions | None = None,
    **measured: Any,
) -> Figures:
    """The figures of one scenario, from the witnesses; ``published`` and ``record`` (the
    announcements and the worker's execution record) and ``measured`` (what else it saw)
    join the details."""
    accepted = submission.accepted
    writes = terminal_writes(transitions)
    terminal = {i for i in accepted if writes.get(i, 0) > 0}
    written_twice = sorted(i for i in accepted if writes.get(i, 0) > 1)
    bad_attempts = sorted(
        i
        for i, r in rows.items()
        if r.status in ("succeeded", "failed") and not 1 <= r.attempts <= max_attempts
    )
    ran = {i: computations.per_job[i] for i in accepted}
    # A stored result names the computation it came from: one the sim witnessed.
    unwitnessed = sorted(
        i
        for i, r in rows.items()
        if r.status == "succeeded"
        and (
            not isinstance(r.output, dict)
            or r.output.get("nonce") not in computations.nonces.get(i, ())
        )
    )
    # The row says terminal and no terminal write was logged: the trigger missed one.
    untracked = sorted(
        i for i, r in rows.items() if r.status in TERMINAL_STATUSES and i not in terminal
    )
    cross_check: dict[str, Any] = {}
    if published is not None:
        cross_check["announced_twice"] = sum(1 for i in accepted if published[i] > 1)
        cross_check["unannounced_terminal"] = len(terminal - set(published))
    if record is not None:
        cross_check["record_executions"] = sum(record.per_job[i] for i in accepted)
        cross_check["record_after_crash"] = sum(record.after_crash[i] for i in accepted)
        cross_check["record_run_twice"] = sum(record.run_twice[i] for i in accepted)
    return Figures(
        scenario=scenario,
        submitted=len(accepted),
        completed=len(terminal),
        lost=len(accepted) - len(terminal),
        executions=sum(ran.values()),
        after_crash=sum(computations.after_crash[i] for i in accepted),
        run_twice=sum(computations.run_twice[i] for i in accepted),
        written_twice=len(written_twice),
        seconds=round(seconds, 1),
        details={
            "statuses": dict(Counter(r.status for r in rows.values())),
            "missing_rows": len(accepted) - len(rows),
            "attempts": dict(sorted(Counter(r.attempts for r in rows.values()).items())),
            "bad_attempts": len(bad_attempts),
            "executions_per_job": dict(sorted(Counter(ran.values()).items())),
            # A result with no witnessed computation behind it, or not one of its nonces.
            "succeeded_unexecuted": unwitnessed[:20],
            "terminal_untracked": untracked[:20],
            "untagged_computations": computations.untagged,
            "after_crash_ids": sorted(set(computations.after_crash) & set(accepted))[:20],
            "run_twice_ids": sorted(set(computations.run_twice) & set(accepted))[:20],
            "written_twice_ids": written_twice[:20],
            **cross_check,
            "lost_ids": sorted(set(accepted) - terminal)[:20],
            "rejected": submission.rejected[:20],
            "retried": dict(submission.retried),
            "submit_s": round(submission.seconds, 1),
            "replayed_after_retry": len(submission.replayed),
            **measured,
        },
    )
