"""What a scenario submitted, completed, lost, ran and wrote twice, counted from what it gathered.

Submitted: the jobs a 202 answered for. Lost: submitted, never terminal.
Executions: the jobs the workers computed, counted from their execution
record (``workers.gpu.executions``), which every worker appends to before it
writes a batch's outcomes, so it does not depend on the conditional write the
counts check. A job computed more than once was either re-run after a crash
(its first computation's process died before writing it) or run twice, which
nothing excuses: the conditional write kept one result, but the work was done
twice. Written twice: job ids the workers announced more than once on the done
channel (see ``harness.listener``), that is results recorded twice.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from core.db import TERMINAL_STATUSES
from harness.submitting import Submission
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
class Figures:
    scenario: str
    submitted: int
    completed: int
    lost: int
    executions: int  # computations of the submitted jobs, from the execution record
    after_crash: int  # re-runs a dead worker explains
    run_twice: int  # re-runs nothing explains (must be 0)
    written_twice: int  # results announced more than once (must be 0)
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
    rows: dict[str, Any]  # job id -> row (id, status, attempts, error, ...)
    published: Counter[str]
    executions: Executions


def tally(
    scenario: str,
    submission: Submission,
    rows: dict[str, Any],
    published: Counter[str],
    executions: Executions,
    seconds: float,
    max_attempts: int,
    **measured: Any,
) -> Figures:
    """The figures of one scenario; ``measured`` (what else it saw) joins the details."""
    accepted = submission.accepted
    terminal = {i for i, r in rows.items() if r.status in TERMINAL_STATUSES}
    written_twice = sorted(i for i, n in published.items() if n > 1)
    bad_attempts = sorted(
        i
        for i, r in rows.items()
        if r.status in ("succeeded", "failed") and not 1 <= r.attempts <= max_attempts
    )
    ran = {i: executions.per_job[i] for i in accepted}
    return Figures(
        scenario=scenario,
        submitted=len(accepted),
        completed=len(terminal),
        lost=len(accepted) - len(terminal),
        executions=sum(ran.values()),
        after_crash=sum(executions.after_crash[i] for i in accepted),
        run_twice=sum(executions.run_twice[i] for i in accepted),
        written_twice=len(written_twice),
        seconds=round(seconds, 1),
        details={
            "statuses": dict(Counter(r.status for r in rows.values())),
            "missing_rows": len(accepted) - len(rows),
            "attempts": dict(sorted(Counter(r.attempts for r in rows.values()).items())),
            "bad_attempts": len(bad_attempts),
            "executions_per_job": dict(sorted(Counter(ran.values()).items())),
            # A result with no computation behind it: the record missed one.
            "succeeded_unexecuted": sorted(
                i for i, r in rows.items() if r.status == "succeeded" and not ran[i]
            )[:20],
            "after_crash_ids": sorted(set(executions.after_crash) & set(accepted))[:20],
            "run_twice_ids": sorted(set(executions.run_twice) & set(accepted))[:20],
            "published_ids": len(published),
            "unpublished_terminal": len(terminal - set(published)),
            "written_twice_ids": written_twice[:20],
            "lost_ids": sorted(set(accepted) - terminal)[:20],
            "rejected": submission.rejected[:20],
            "retried": dict(submission.retried),
            "submit_s": round(submission.seconds, 1),
            "replayed_after_retry": len(submission.replayed),
            **measured,
        },
    )
