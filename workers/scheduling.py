"""The worker's side of the scheduler: settings to tuning, the policy to apply, what to publish."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backends.base import Runtime
from core.estimates import ModelEstimate
from core.settings import Settings
from scheduler import BatchDecision, PendingItem, decide
from scheduler.baselines import decide_fixed, decide_single
from scheduler.learning import SchedulerState, Tuning
from scheduler.policy import INF, LinearFit

Policy = Callable[[Sequence[PendingItem], float], BatchDecision]


def tuning_for(settings: Settings, runtime: Runtime) -> Tuning:
    """``settings`` must already carry the model's overrides (``Settings.for_model``)."""
    target = settings.latency_target_ms
    return Tuning(
        max_batch_size=settings.batch_max_size,
        max_batch_cost=float(settings.batch_max_cost) if settings.batch_max_cost else INF,
        padded=runtime.padded,
        memory_budget_bytes=runtime.memory_budget_bytes(),
        memory_threshold=settings.memory_threshold,
        window_min_s=settings.batch_window_min_ms / 1000.0,
        window_max_s=settings.batch_window_max_ms / 1000.0,
        latency_target_s=target / 1000.0 if target is not None else None,
        bulk_share=settings.bulk_share,
        bulk_ride_factor=settings.bulk_ride_factor,
        window_start_factor=settings.batch_window_start_factor,
        window_shrink=settings.batch_window_shrink,
        window_grow=settings.batch_window_grow,
        latency_high=settings.latency_high_factor,
        latency_low=settings.latency_low_factor,
        history_weight=settings.batch_cost_history_weight,
        idle_queue=settings.idle_queue_max,
        forget=settings.learning_forget,
        oom_backoff=settings.oom_backoff,
        urgent_guard=settings.urgent_guard,
        urgent_budget=settings.urgent_budget,
        urgent_memory_s=settings.urgent_memory_s,
        min_efficiency=settings.batch_min_efficiency,
    )


def build_state(settings: Settings, runtime: Runtime) -> SchedulerState:
    """A fresh state whose first estimates come from the runtime itself."""
    calibrated = runtime.calibrate()
    m0, m1 = runtime.declared_memory()
    span = calibrated[2] if calibrated else 1.0
    return SchedulerState.create(
        tuning_for(settings, runtime),
        latency_prior=LinearFit(calibrated[0], calibrated[1]) if calibrated else None,
        memory_prior=LinearFit(m0, m1),
        prior_span=span,
    )


def make_policy(kind: str, state: SchedulerState, fixed_max_delay_s: float) -> Policy:
    if kind == "ferry":
        return lambda items, now: decide(items, state.profile(now), now)
    if kind == "fixed":
        size = state.tuning.max_batch_size
        return lambda items, now: decide_fixed(items, size, fixed_max_delay_s, now)
    if kind == "none":
        return decide_single
    raise ValueError(f"unknown scheduler {kind!r} (ferry, fixed or none)")


def estimate_of(state: SchedulerState, mean_cost: float, pad_ratio: float) -> ModelEstimate:
    fit = state.latency.fit()
    return ModelEstimate(
        latency_a_s=fit.intercept,
        latency_b_s=fit.slope,
        padded=state.tuning.padded,
        max_batch_size=state.tuning.max_batch_size,
        # The standing caps (cost, memory), not the urgent guard's passing one.
        max_batch_cost=min(
            state.tuning.max_batch_cost, state.memory.fit().inverse(state.memory_ceiling)
        ),
        mean_cost=mean_cost,
        pad_ratio=pad_ratio,
        window_s=state.window_s or 0.0,
    )
