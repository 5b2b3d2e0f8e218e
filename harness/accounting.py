"""What a scenario submitted, completed, lost and duplicated, counted from what it gathered.

Submitted: the jobs a 202 answered for. Lost: submitted, never terminal.
Duplicated: job ids the workers announced more than once on the done channel
(see ``harness.listener``), that is jobs recorded twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from core.db import TERMINAL_STATUSES
from harness.submitting import Submission


@dataclass
class Figures:
    scenario: str
    submitted: int
    completed: int
    lost: int
    duplicated: int
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)

    def row(self) -> str:
        return (
            f"{self.scenario:<28} | {self.submitted:>9} | {self.completed:>9} | "
            f"{self.lost:>4} | {self.duplicated:>10} | {self.seconds:>7.1f}"
        )


HEADER = (
    f"{'scenario':<28} | {'submitted':>9} | {'completed':>9} | "
    f"{'lost':>4} | {'duplicated':>10} | {'seconds':>7}"
)
FIGURES: list[Figures] = []


@dataclass
class Accounting:
    figures: Figures
    rows: dict[str, Any]  # job id -> row (id, status, attempts, error, ...)
    published: Counter[str]


def tally(
    scenario: str,
    submission: Submission,
    rows: dict[str, Any],
    published: Counter[str],
    seconds: float,
    max_attempts: int,
    **measured: Any,
) -> Figures:
    """The figures of one scenario; ``measured`` (what else it saw) joins the details."""
    accepted = submission.accepted
    terminal = {i for i, r in rows.items() if r.status in TERMINAL_STATUSES}
    duplicated = sorted(i for i, n in published.items() if n > 1)
    bad_attempts = sorted(
        i
        for i, r in rows.items()
        if r.status in ("succeeded", "failed") and not 1 <= r.attempts <= max_attempts
    )
    return Figures(
        scenario=scenario,
        submitted=len(accepted),
        completed=len(terminal),
        lost=len(accepted) - len(terminal),
        duplicated=len(duplicated),
        seconds=round(seconds, 1),
        details={
            "statuses": dict(Counter(r.status for r in rows.values())),
            "missing_rows": len(accepted) - len(rows),
            "attempts": dict(sorted(Counter(r.attempts for r in rows.values()).items())),
            "bad_attempts": len(bad_attempts),
            "published_ids": len(published),
            "unpublished_terminal": len(terminal - set(published)),
            "duplicated_ids": duplicated[:20],
            "lost_ids": sorted(set(accepted) - terminal)[:20],
            "rejected": submission.rejected[:20],
            "retried": dict(submission.retried),
            "submit_s": round(submission.seconds, 1),
            "replayed_after_retry": len(submission.replayed),
            **measured,
        },
    )
