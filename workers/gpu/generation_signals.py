"""What a generation worker tells the rest of Ferry: the API's estimates, metrics, Flower.

Beside the loop, never in its way: once per step it sets the step's metrics
and, at most every ``PUBLISH_S``, writes what it learned into the model's
stats hash (:class:`~core.models.generation_estimates.GenerationEstimate`: the step
time fit, the KV pool, the limits, the usual job, step or generate); once
per job it learns the job's size when it is read and observes its TTFT, TPOT
and finish reason when it ends. Nothing here runs per token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis

from core.models.generation_estimates import Execution, GenerationEstimate
from core.ops.metrics import (
    GENERATION_CACHED_TOKENS,
    GENERATION_JOBS_ENDED,
    GENERATION_KV_BLOCKS_BUDGET,
    GENERATION_KV_BLOCKS_IN_USE,
    GENERATION_PREEMPTIONS,
    GENERATION_SEQUENCES,
    GENERATION_STEP_SECONDS,
    GENERATION_STEPS,
    GENERATION_TOKENS,
    GENERATION_TPOT,
    GENERATION_TTFT,
)
from core.streams.protocol import stats_key
from core.streams.target import REDIS_ERRORS
from scheduler.generation import GenerationLimits, GenerationScheduler
from workers.gpu.engine import StepEvents
from workers.gpu.learned import PUBLISH_S

log = logging.getLogger(__name__)

# Recent jobs weigh this much in the usual job's sizes (the first one counts whole).
SIZE_ALPHA = 0.1
# The tokens-per-second figure Flower shows: smoothed over about this long.
RATE_WINDOW_S = 5.0


@dataclass
class _Mean:
    value: float = 0.0
    seen: int = 0

    def add(self, x: float) -> None:
        self.seen += 1
        self.value += (1.0 if self.seen == 1 else SIZE_ALPHA) * (x - self.value)


@dataclass(eq=False)
class GenerationSignals:
    """One generation worker's published figures, metrics and facts for Flower."""

    client: redis.Redis
    prefix: str
    model: str
    limits: GenerationLimits
    execution: Execution
    why: str = ""
    bytes_per_block: int = 0
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        self.prompt_tokens = _Mean()
        self.max_tokens = _Mean()
        self.completion_tokens = _Mean()
        self.tokens_per_s = 0.0
        self._published_at: float | None = None
        self._rate_at = time.monotonic()
        self._rate_tokens = 0
        # Bound once: a labelled child is a dictionary look-up fewer per step.
        model = self.model
        self._tokens = GENERATION_TOKENS.labels(model)
        self._steps = GENERATION_STEPS.labels(model)
        self._step_s = GENERATION_STEP_SECONDS.labels(model)
        self._in_use = GENERATION_KV_BLOCKS_IN_USE.labels(model)
        self._running = GENERATION_SEQUENCES.labels(model, "running")
        self._waiting = GENERATION_SEQUENCES.labels(model, "waiting")
        self._preempted = GENERATION_PREEMPTIONS.labels(model)
        self._cached = GENERATION_CACHED_TOKENS.labels(model)
        GENERATION_KV_BLOCKS_BUDGET.labels(model).set(self.limits.kv_blocks)

    # --- the loop's side ---------------------------------------------------------

    def job_read(self, prompt_tokens: int, max_tokens: int) -> None:
        self.prompt_tokens.add(prompt_tokens)
        self.max_tokens.add(max_tokens)

    def job_ended(
        self, lane: str, finish_reason: str, completion_tokens: int, timings: dict[str, Any]
    ) -> None:
        """A job ended (``timings``: its output's, empty for one that never ran)."""
        GENERATION_JOBS_ENDED.labels(self.model, finish_reason).inc()
        if finish_reason in ("stop", "length"):
            self.completion_tokens.add(completion_tokens)
        ttft_ms, tpot_ms = timings.get("ttft_ms"), timings.get("tpot_ms")
        if ttft_ms is not None:
            GENERATION_TTFT.labels(self.model, lane).observe(ttft_ms / 1000.0)
        if tpot_ms is not None:
            GENERATION_TPOT.labels(self.model, lane).observe(tpot_ms / 1000.0)

    def stepped(self, events: StepEvents, scheduler: GenerationScheduler) -> None:
        """After every engine step (idle ones too: the gauges and the hash stay current)."""
        if not events.idle and not events.aborted:
            self._steps.inc()
            self._step_s.observe(events.step_s)
            if events.emitted:
                self._tokens.inc(len(events.emitted))
                self._rate_tokens += len(events.emitted)
            if events.plan.preempted:
                self._preempted.inc(len(events.plan.preempted))
            if events.plan.cached:
                self._cached.inc(sum(events.plan.cached.values()))
        self._in_use.set(scheduler.blocks_used)
        self._running.set(scheduler.running_count)
        self._waiting.set(scheduler.waiting_count)
        now = time.monotonic()
        if self._published_at is None or now - self._published_at >= PUBLISH_S:
            self._rate(now)
            self.publish(scheduler, now)

    # --- what is published -------------------------------------------------------

    def estimate(self, scheduler: GenerationScheduler) -> GenerationEstimate:
        fit = scheduler.step_fit
        limits = self.limits
        return GenerationEstimate(
            execution=self.execution,
            why=self.why,
            step_a_s=fit.intercept,
            step_b_s=fit.slope,
            kv_blocks=limits.kv_blocks,
            block_size=limits.block_size,
            bytes_per_block=self.bytes_per_block,
            max_running=limits.max_running,
            step_tokens=limits.step_tokens,
            prefill_chunk_tokens=limits.prefill_chunk_tokens,
            running=scheduler.running_count,
            waiting=scheduler.waiting_count,
            mean_prompt_tokens=self.prompt_tokens.value,
            mean_max_tokens=self.max_tokens.value,
            mean_completion_tokens=self.completion_tokens.value,
            prefix_caching=self.prefix_caching,
        )

    def publish(self, scheduler: GenerationScheduler, now: float) -> None:
        self._published_at = now
        mapping = self.estimate(scheduler).to_hash()
        try:
            self.client.hset(stats_key(self.prefix, self.model), mapping=mapping)  # type: ignore[arg-type]
        except REDIS_ERRORS as exc:
            # Advisory (the API's estimates): the step's work stands; the next publishes.
            log.warning(
                "learned figures not published",
                extra={"model": self.model, "error_type": type(exc).__name__},
            )

    def _rate(self, now: float) -> None:
        elapsed = now - self._rate_at
        if elapsed <= 0:
            return
        weight = min(1.0, elapsed / RATE_WINDOW_S)
        self.tokens_per_s += weight * (self._rate_tokens / elapsed - self.tokens_per_s)
        self._rate_at, self._rate_tokens = now, 0

    def facts(self, scheduler: GenerationScheduler) -> dict[str, Any]:
        """What Flower's worker page shows of it, beside Celery's own figures."""
        fit = scheduler.step_fit
        return {
            "execution": self.execution,
            "running_sequences": scheduler.running_count,
            "waiting_sequences": scheduler.waiting_count,
            "kv_blocks_in_use": scheduler.blocks_used,
            "kv_blocks": self.limits.kv_blocks,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "step_fixed_ms": round(fit.intercept * 1000.0, 3),
            "step_per_token_ms": round(fit.slope * 1000.0, 6),
        }
