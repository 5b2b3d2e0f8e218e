"""One generation step: ``schedule()`` → execute → ``update_from_output()``, one way.

The engine core of a generation model, in the shape of vLLM's: the
scheduler decides, the runtime executes, and this is the only place that
reports the runtime's output back to the scheduler. It reads no clock (the
caller passes ``now``), so the worker's loop, the benchmark and the tests
drive the same object. What a step did comes back as :class:`StepEvents`
for the caller to act on: jobs to claim, tokens to stream, results to record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from backends.generation.runtime import Completion, Emitted, GenerationInput, StepResult
from scheduler.generation import (
    FinishReason,
    GenerationRequest,
    GenerationScheduler,
    StepPlan,
)


class StepRunner(Protocol):
    """What the engine needs of a runtime (``StepRuntime`` and ``WholeRuntime``).

    ``resumable``: it takes a job's ``resumed`` tokens and goes on from them.
    """

    resumable: bool

    def add(self, id: str, job: GenerationInput) -> None: ...

    def holds(self, id: str) -> bool: ...

    def reset(self, id: str) -> None: ...

    def clear(self) -> None: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def pop(self, id: str, reason: FinishReason) -> Completion: ...


@dataclass(frozen=True)
class StepEvents:
    """What one step did.

    ``admitted``: jobs that started (first time) this step. ``emitted``:
    each sequence's new token and text. ``ended``: every job that ended this
    step, with its result: finished (stop, length), cancelled, or expired
    (never ran: no tokens). ``plan``: the scheduler's decision, for
    observers. ``step_s``: the device's time for it (0 when nothing ran).
    ``aborted``: the runtime raised (``error``), and the sequences it
    computed wait again, each to run alone (nothing of the step is kept).
    """

    plan: StepPlan
    admitted: tuple[str, ...] = ()
    emitted: Mapping[str, Emitted] = field(default_factory=dict)
    ended: Mapping[str, Completion] = field(default_factory=dict)
    step_s: float = 0.0
    aborted: tuple[str, ...] = ()
    error: Exception | None = None

    @property
    def idle(self) -> bool:
        return self.plan.empty and not self.ended


class GenerationEngine:
    """A generation model's scheduler and runtime, stepped together."""

    def __init__(self, scheduler: GenerationScheduler, runtime: StepRunner) -> None:
        self.scheduler = scheduler
        self.runtime = runtime

    def add(self, request: GenerationRequest, job: GenerationInput) -> None:
        """Queue a job; ValueError (from the scheduler) when it can never fit."""
        self.scheduler.add(request)
        self.runtime.add(request.id, job)

    def reset(self) -> None:
        """Forget everything, the plan in flight too (:meth:`GenerationScheduler.reset`)."""
        self.scheduler.reset()
        self.runtime.clear()

    def fail(self, id: str) -> Completion:
        """End ``id`` now, outside a step (it failed alone): its result so far."""
        self.scheduler.cancel(id)  # the next plan names it; the runtime no longer holds it
        return self.runtime.pop(id, FinishReason.CANCELLED)

    def cancel(self, id: str) -> bool:
        """Stop a job, waiting or running; it ends ``cancelled`` at the next step."""
        return self.scheduler.cancel(id)

    def step(self, now: float) -> StepEvents:
        """Schedule at ``now``, execute the plan, report its output; the step's events."""
        plan = self.schedule(now)
        return self.update_from_output(plan, self.execute(plan), now)

    def schedule(self, now: float) -> StepPlan:
        """The scheduler's plan for the step at ``now``."""
        return self.scheduler.schedule(now)

    def execute(self, plan: StepPlan) -> StepResult:
        """The runtime runs the plan (nothing for a plan that computes nothing)."""
        return self.runtime.execute(plan)

    def abort(self, plan: StepPlan, error: Exception) -> StepEvents:
        """The runtime raised ``error`` executing ``plan``: the sequences it computed lose
        their KV, wait again and run alone from now on (:meth:`GenerationScheduler.abort`);
        what the plan ended before it ran (cancelled, expired) still ends."""
        computed = self.scheduler.abort(plan)
        for id in computed:
            if self.runtime.holds(id):
                self.runtime.reset(id)
        return StepEvents(plan=plan, ended=self._ended(plan, {}), aborted=computed, error=error)

    def update_from_output(self, plan: StepPlan, result: StepResult, now: float) -> StepEvents:
        """Report what the step computed to the scheduler (``now``: when the step began);
        the step's events, with every ended job's result taken from the runtime."""
        self.scheduler.update_from_output(plan, result.output, now + result.output.step_s)
        return StepEvents(
            plan=plan,
            admitted=plan.admitted,
            emitted=result.emitted,
            ended=self._ended(plan, result.output.finished),
            step_s=result.output.step_s if not plan.empty else 0.0,
        )

    def _ended(self, plan: StepPlan, finished: Mapping[str, FinishReason]) -> dict[str, Completion]:
        """Every job the step ended, its result taken from the runtime."""
        ended: dict[str, Completion] = {}
        for id, reason in plan.ended.items():
            if self.runtime.holds(id):
                ended[id] = self.runtime.pop(id, reason)
        for id in plan.expired:
            ended[id] = self.runtime.pop(id, FinishReason.EXPIRED)
        for id, reason in finished.items():
            ended[id] = self.runtime.pop(id, reason)
        return ended
