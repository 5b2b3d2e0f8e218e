"""A version on trial: a deploy that loads and then fails every batch is rolled back.

Loading proves that a version builds, not that it computes: a model whose
``predict`` raises on every input loads and warms up (on inputs of its own)
and would then fail every job it is given. After the loop switches to a new
version it keeps the version it replaced loaded, and judges the new one on
its first batches. A batch whose every job failed (bisected down to each
input alone, so it is the model and not one input) is held: neither recorded
nor acknowledged. The first batch with a job that succeeds ends the trial:
the held batches' failures are the inputs' own, recorded as they came, and
the old version is dropped. ``failures`` whole-failed batches in a row end it
the other way: the loop serves the old version again and runs the held
batches' jobs on it, so no job fails for a bad deploy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from workers.gpu.consumer import Entry
from workers.gpu.device import Computed, InFlight
from workers.gpu.versions import Loaded


class Verdict(Enum):
    PASS = "pass"  # a job succeeded on the new version: the trial is over, kept
    HOLD = "hold"  # every job of the batch failed: held until the trial ends
    ROLL_BACK = "roll back"  # held, and the failures reached the limit


@dataclass
class Probation:
    """The version switched from (still loaded) and the batches the new one failed whole."""

    previous: Loaded
    failures: int  # whole-failed batches in a row that roll the new version back
    held: list[tuple[InFlight, Computed]] = field(default_factory=list)
    last_error: str = ""

    def judge(self, flight: InFlight, computed: Computed) -> Verdict:
        """What a batch of the new version (one that claimed jobs) says of it."""
        results = computed.results
        if any(result.ok for result in results):
            return Verdict.PASS
        self.held.append((flight, computed))
        self.last_error = next((r.error for r in results if r.error), self.last_error)
        return Verdict.ROLL_BACK if self.failed else Verdict.HOLD

    @property
    def failed(self) -> bool:
        """Whether the new version failed its trial."""
        return len(self.held) >= self.failures

    def ended(self) -> list[tuple[InFlight, Computed]]:
        """The batches held, handed back (the trial is over)."""
        held, self.held = self.held, []
        return held

    def held_entries(self) -> list[Entry]:
        return [entry for flight, _ in self.held for entry in flight.entries]

    def reason(self, version: int) -> str:
        return (
            f"every job of its first {len(self.held)} batches failed; rolled back to version "
            f"{self.previous.version} (version {version}: {self.last_error or 'no error'})"
        )[:500]
