"""The worker's side of the scheduler: settings to tuning, a version's batcher, what to publish."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from backends.base import Runtime
from core.models.estimates import ModelEstimate
from scheduler import Batcher
from scheduler.learning import SchedulerState, Tuning
from scheduler.policy import LinearFit
from scheduler.vocabulary import PolicyKind


@dataclass(frozen=True)
class BatchingSettings:
    """A model's batching (``Settings.section`` of the settings it runs with,
    ``Settings.for_model``): its knobs, the policy, and the fixed policy's delay."""

    tuning: Tuning
    scheduler: PolicyKind
    fixed_max_delay_ms: float


def tuning_for(tuning: Tuning, runtime: Runtime) -> Tuning:
    """``tuning`` (each knob the setting of the same name), with what the runtime says:
    whether the model pads its inputs and how much memory it may use."""
    return replace(tuning, padded=runtime.padded, memory_budget_bytes=runtime.memory_budget_bytes())


def build_state(tuning: Tuning, runtime: Runtime) -> SchedulerState:
    """A fresh state whose first estimates come from the runtime itself."""
    calibrated = runtime.calibrate()
    m0, m1 = runtime.declared_memory()
    span = calibrated[2] if calibrated else 1.0
    return SchedulerState.create(
        tuning_for(tuning, runtime),
        latency_prior=LinearFit(calibrated[0], calibrated[1]) if calibrated else None,
        memory_prior=LinearFit(m0, m1),
        prior_span=span,
    )


def build_batcher(batching: BatchingSettings, runtime: Runtime) -> Batcher[Any]:
    """The batcher of a version of a model: its state learned from the runtime's calibration."""
    return Batcher(
        build_state(batching.tuning, runtime),
        batching.scheduler,
        batching.fixed_max_delay_ms / 1000.0,
    )


def estimate_of(state: SchedulerState, mean_cost: float, pad_ratio: float) -> ModelEstimate:
    fit = state.latency.fit()
    return ModelEstimate(
        latency_a_s=fit.intercept,
        latency_b_s=fit.slope,
        padded=state.tuning.padded,
        max_batch_size=state.max_batch_size,
        # The standing caps (cost, memory), not the urgent guard's passing one.
        max_batch_cost=min(state.tuning.cost_cap, state.memory.fit().inverse(state.memory_ceiling)),
        mean_cost=mean_cost,
        pad_ratio=pad_ratio,
        window_s=state.window_s or 0.0,
    )
