"""A circuit breaker per model: shed bulk work first, then normal, while a model is overloaded.

The queue bound (``FERRY_QUEUE_MAX_JOBS``) keeps Redis from filling; the
breaker keeps the latency of the traffic that matters. The model's workers
publish, with their learned figures, the p99 latency of the jobs they
finished in the last seconds, by lane (accepted to finished), their latency
target (``FERRY_LATENCY_TARGET_MS``: the model's SLA; a model without one is
never shed for its latency, since a backlog is what its queue is for) and the
share of their memory budget their last batch peaked at. A model whose
interactive p99 (its urgent, vip and normal lanes) passes
``FERRY_BREAKER_LATENCY_FACTOR`` times its target, or whose memory passes
``FERRY_BREAKER_MEMORY_FRACTION``, sheds ``bulk``; at twice the factor, or
halfway from that fraction to all of the memory, ``normal`` too. ``urgent``
and ``vip`` are never shed. The breaker opens at once and closes one level at
a time, once the signal has stayed below the level for ``FERRY_BREAKER_COOL_S``:
it closes by itself when shedding has let the queue drain.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.ops.metrics import BREAKER_LEVEL

# What each level sheds, in the order it sheds them.
SHED: tuple[frozenset[str], ...] = (frozenset(), frozenset({"bulk"}), frozenset({"bulk", "normal"}))
INTERACTIVE = ("urgent", "vip", "normal")


@dataclass(frozen=True)
class Load:
    """What a model's workers published of their load (core.streams.queues' stats hash)."""

    p99_ms: dict[str, float]  # by lane, of the jobs finished in the last seconds
    latency_target_ms: float | None
    memory_fraction: float | None

    @classmethod
    def from_stats(cls, stats: dict[str, float]) -> Load:
        return cls(
            p99_ms={
                k.removeprefix("p99_ms_"): v for k, v in stats.items() if k.startswith("p99_ms_")
            },
            latency_target_ms=stats.get("latency_target_ms") or None,
            memory_fraction=stats.get("memory_fraction"),
        )

    @property
    def interactive_p99_ms(self) -> float:
        return max((self.p99_ms.get(lane, 0.0) for lane in INTERACTIVE), default=0.0)


@dataclass(frozen=True)
class BreakerPolicy:
    latency_factor: float = 4.0  # 0: never on latency
    memory_fraction: float = 0.9  # 1 or more: never on memory
    cool_s: float = 5.0

    def level(self, load: Load) -> tuple[int, str]:
        """The level ``load`` calls for, and why (empty at level 0)."""
        level, why = 0, ""
        target = load.latency_target_ms
        p99 = load.interactive_p99_ms
        if self.latency_factor > 0 and target:
            for n, factor in ((1, self.latency_factor), (2, 2 * self.latency_factor)):
                if p99 > factor * target:
                    level = n
                    why = (
                        f"its p99 latency is {p99:.0f} ms, over {factor:g}x its target of "
                        f"{target:.0f} ms"
                    )
        memory = load.memory_fraction
        if memory is not None and self.memory_fraction < 1:
            for n, limit in ((1, self.memory_fraction), (2, (1 + self.memory_fraction) / 2)):
                if memory > limit and n > level:
                    level = n
                    why = f"its memory is at {memory:.0%}, over {limit:.0%}"
        return level, why


class Breaker:
    """Each model's level, opened at once and closed a level per ``cool_s`` of calm."""

    def __init__(self, policy: BreakerPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self._lock = threading.Lock()
        # model -> (level, why, since when the signal has called for less)
        self._state: dict[str, tuple[int, str, float | None]] = {}

    def update(self, model: str, load: Load | None) -> tuple[int, str]:
        """The model's level after reading ``load`` (None: nothing published: it cools)."""
        wanted, why = self.policy.level(load) if load is not None else (0, "")
        now = self.clock()
        with self._lock:
            level, was, calm_since = self._state.get(model, (0, "", None))
            if wanted >= level:
                level, was, calm_since = wanted, why, None
            elif calm_since is None:
                calm_since = now
            elif now - calm_since >= self.policy.cool_s:
                level, calm_since = level - 1, (now if level - 1 > wanted else None)
                was = why if level == wanted else was
            self._state[model] = (level, was, calm_since)
        BREAKER_LEVEL.labels(model).set(level)
        return level, was

    def sheds(self, model: str, lane: str, load: Load | None) -> str | None:
        """Why a job of ``lane`` is refused now, or None."""
        level, why = self.update(model, load)
        return why if lane in SHED[level] else None
