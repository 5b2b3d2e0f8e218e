"""What a worker learns about its model, batch after batch, and the profile it derives.

:class:`SchedulerState` is fed observations (arrivals, finished batches,
out-of-memory errors) by the caller, which supplies every timestamp; it never
reads a clock. :meth:`SchedulerState.profile` turns what it knows into the
:class:`~scheduler.policy.Profile` that :func:`~scheduler.policy.decide` uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TypeVar

from scheduler.policy import INF, LinearFit, Profile
from scheduler.vocabulary import BATCH_SIZE_CEILING, BATCH_SIZE_FLOOR, Lane

CEILING_RELAX_AFTER = 100  # clean batches before a lowered memory ceiling rises again
CEILING_RELAX_STEP = 1.02  # by this factor, up to the threshold

# A batch is long enough once its fixed cost (the latency fit's intercept) is
# at most 1 / BATCH_KNEE of its variable cost: 80 % of the throughput that no
# batch size can beat; past it, a longer batch adds latency for little gain.
BATCH_KNEE = 4.0

_T = TypeVar("_T")


def derived_batch_size(latency: LinearFit, work_cap: float, item_cost: float) -> int:
    """The most jobs in a batch of a model whose ``batch_max_size`` is unset.

    As many jobs of the usual ``item_cost`` as the work a batch is worth
    doing: the work at which the model's fixed cost per batch is amortised
    (``BATCH_KNEE`` x intercept / slope of its latency), and no more than
    ``work_cap`` (the cost cap and what the memory budget admits), within
    ``BATCH_SIZE_FLOOR`` and ``BATCH_SIZE_CEILING``. A model with a large fixed
    cost per batch (a small model on a GPU) gets large batches; one whose
    latency is all per-token work (the CPU) gains nothing from them and keeps
    the floor, as does a model whose latency is not known yet.
    """
    if latency.slope > 0:
        worth = BATCH_KNEE * latency.intercept / latency.slope
    else:  # every batch costs the same: worth filling, if it costs anything
        worth = INF if latency.intercept > 0 else 0.0
    work = min(worth, work_cap)
    if work <= 0 or math.isnan(work):
        return BATCH_SIZE_FLOOR
    count = work / max(item_cost, 1.0) * (1 + 1e-9)  # a fit's rounding never costs a job
    return int(min(BATCH_SIZE_CEILING, max(BATCH_SIZE_FLOOR, count)))


@dataclass(frozen=True)
class Knob:
    """A batching knob as its setting (``FERRY_<NAME>``) states it: the description and the
    bounds the setting enforces, and its type where it is not the field's."""

    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    setting_type: object = None


def knob(
    default: _T,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    setting_type: object = None,
) -> _T:
    """A field of :class:`Tuning` that is also a setting of the same name, stated here once:
    core.config.settings derives the setting (default, bounds, description) from it."""
    return field(default=default, metadata={"knob": Knob(doc, ge, gt, le, lt, setting_type)})


@dataclass(frozen=True)
class Tuning:
    """Every knob of the scheduler for one model.

    Each knob (a field made by :func:`knob`) is the setting of the same name
    (``FERRY_BATCH_MAX_SIZE`` is ``batch_max_size`` here): its default, bounds
    and description are stated here alone, and the settings, their per-model
    overrides and docs/settings.md are derived from them. ``padded`` and
    ``memory_budget_bytes`` come from the model's runtime (the latter: the
    setting if given, else what the device has). ``batch_max_size`` None:
    derived from what is learned of the model (:func:`derived_batch_size`,
    :attr:`SchedulerState.max_batch_size`).
    """

    batch_max_size: int | None = knob(
        None,
        """The most jobs in one batch. Unset: derived per model from what its worker learns, between
    32 and 256: as many of the usual jobs as make a batch worth its fixed cost (4 x the
    intercept over the slope of the latency fit), within `FERRY_BATCH_MAX_COST` and the
    memory budget (`docs/scheduler.md`). The `fixed` scheduler takes 32.""",
        ge=1,
        le=4096,
    )
    # Work units (padded tokens for a padded model); None: no cap.
    batch_max_cost: float | None = knob(
        None,
        """The most work in one batch, in the units of the model's `[cost]` (padded tokens for
    minilm, the sum of costs for sim). Unset: no cost cap; only memory caps it.""",
        ge=1,
        setting_type=int | None,
    )
    # min before max: the settings' field order is this one, and their check that
    # max >= min reads min as already validated.
    batch_window_min_ms: float = knob(
        0.0,
        "Lower clamp of the adaptive window: how long the oldest job may wait for company.",
        ge=0,
    )
    batch_window_max_ms: float = knob(20.0, "Upper clamp of the adaptive window.", ge=0)
    # None: 3 x the average batch latency.
    latency_target_ms: float | None = knob(
        None,
        """The job latency the adaptive window adapts to: it shrinks when jobs take longer than
    this. Unset: three times the average batch latency.""",
        gt=0,
    )
    memory_threshold: float = knob(
        0.8,
        """A batch may be predicted to peak at this share of the memory budget; it is cut before
    the job that would cross it.""",
        gt=0,
        le=1,
    )
    bulk_share: float = knob(
        0.05,
        "The share of each batch's slots kept for the bulk lane while it is backlogged.",
        ge=0,
        lt=1,
    )
    bulk_ride_factor: float = knob(
        1.25,
        """In a batch carrying interactive jobs, bulk jobs past the reserved share ride along only
    while the batch is predicted to take at most this x what the interactive jobs alone
    would.""",
        ge=1,
    )
    # The scheduler's factors (docs/architecture.md §5); the defaults are what bench/ measured.
    batch_window_start_factor: float = knob(
        1.5, "The first window, x the average batch latency.", gt=0
    )
    batch_window_shrink: float = knob(
        0.8, "The window is multiplied by this when job latency is above the target.", gt=0, le=1
    )
    batch_window_grow: float = knob(
        1.2, "The window is multiplied by this when job latency is below the target.", ge=1
    )
    latency_high_factor: float = knob(
        1.2, "Job latency is above the target past this x the target.", ge=1
    )
    latency_low_factor: float = knob(
        0.8, "Job latency is below the target under this x the target.", gt=0, le=1
    )
    batch_cost_history_weight: float = knob(
        0.7,
        "The target batch cost is this x its history + (1 - this) x the demand.",
        ge=0,
        lt=1,
    )
    idle_queue_max: int = knob(
        1, "At most this many pending jobs is a short queue, for the idle trigger.", ge=0
    )
    learning_forget: float = knob(
        0.97,
        "The weight older batches keep in the latency and memory fits at each new batch.",
        gt=0,
        le=1,
    )
    oom_backoff: float = knob(
        0.9,
        """After an out-of-memory error, the memory ceiling drops to this x the failed batch's
    predicted peak.""",
        gt=0,
        lt=1,
    )
    # While urgent jobs are about (one arrived within urgent_memory_s), no batch
    # may be predicted to take longer than urgent_guard x a lone item's latency,
    # and the items riding with urgent ones must let them finish within
    # urgent_budget x it of their arrival: the GPU cannot be preempted, so an
    # urgent job's latency is the running batch's remainder plus its own batch.
    # INF turns either bound off.
    urgent_guard: float = knob(
        1.5,
        """While an urgent job arrived in the last `FERRY_URGENT_MEMORY_S`, no batch may be
    predicted to take over this x a lone job's latency.""",
        ge=1,
    )
    urgent_budget: float = knob(
        2.5,
        """While an urgent job arrived in the last `FERRY_URGENT_MEMORY_S`, urgent jobs must be
    predicted to finish within this x a lone job's latency.""",
        ge=1,
    )
    urgent_memory_s: float = knob(
        1.0,
        """How long an urgent job's arrival holds batches to `FERRY_URGENT_GUARD` and
    `FERRY_URGENT_BUDGET`, and keeps the worker from deciding its next batch before the
    device is free (an urgent job that arrives meanwhile then waits for one batch, not two).""",
        ge=0,
    )
    batch_min_efficiency: float = knob(
        0.92,
        """Padded models, while more is pending than one batch holds: the least share of a batch's
    computed tokens that are not padding.""",
        ge=0,
        le=1,
    )
    # The runtime's own, not settings.
    padded: bool = False
    memory_budget_bytes: float = INF

    def __post_init__(self) -> None:
        if self.batch_max_size is not None and self.batch_max_size < 1:
            raise ValueError("batch_max_size must be at least 1")
        if self.batch_max_cost is not None and not self.batch_max_cost > 0:
            raise ValueError("batch_max_cost must be positive")
        if not 0 <= self.batch_window_min_ms <= self.batch_window_max_ms:
            raise ValueError("window bounds must satisfy 0 <= min <= max")
        if not 0 < self.memory_threshold <= 1:
            raise ValueError("memory_threshold must be in (0, 1]")
        if not 0 <= self.bulk_share < 1:
            raise ValueError("bulk_share must be in [0, 1)")
        if not 0 <= self.batch_cost_history_weight < 1:
            raise ValueError("batch_cost_history_weight must be in [0, 1)")
        if not 0 < self.learning_forget <= 1 or not 0 < self.oom_backoff < 1:
            raise ValueError("learning_forget must be in (0, 1] and oom_backoff in (0, 1)")
        if not (self.urgent_guard >= 1 and self.urgent_budget >= 1):
            raise ValueError("urgent_guard and urgent_budget must be at least 1")
        if not self.urgent_memory_s >= 0:
            raise ValueError("urgent_memory_s must not be negative")
        if not 0 <= self.batch_min_efficiency <= 1:
            raise ValueError("batch_min_efficiency must be in [0, 1]")

    @property
    def cost_cap(self) -> float:
        """``batch_max_cost`` as a bound (INF when unset)."""
        return INF if self.batch_max_cost is None else float(self.batch_max_cost)

    @property
    def most_batch_items(self) -> int:
        """The most jobs a batch may ever hold: a worker reads at least this many."""
        return BATCH_SIZE_CEILING if self.batch_max_size is None else self.batch_max_size


# The knobs a setting of the same name fills, in their order (the others come from the runtime).
KNOBS = tuple(f.name for f in fields(Tuning) if "knob" in f.metadata)


class OnlineFit:
    """Least squares of ``y = a + b x`` with exponential forgetting, ``a, b >= 0``.

    A prior (for example the model's declared memory use, or a latency
    measured at start-up) counts as two observations until real ones outweigh it.
    """

    def __init__(
        self, prior: LinearFit | None = None, forget: float = 0.97, prior_span: float = 1.0
    ) -> None:
        self.forget = forget
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.observations = 0
        self._prior = prior
        if prior is not None:
            for x in (0.0, prior_span):
                self._add(x, prior(x), 1.0)

    def _add(self, x: float, y: float, weight: float) -> None:
        self._w += weight
        self._x += weight * x
        self._y += weight * y
        self._xx += weight * x * x
        self._xy += weight * x * y

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        for name in ("_w", "_x", "_y", "_xx", "_xy"):
            setattr(self, name, getattr(self, name) * self.forget)
        self._add(x, y, 1.0)
        self.observations += 1

    @property
    def known(self) -> bool:
        return self._w > 0

    def fit(self) -> LinearFit:
        if self._w <= 0:
            return LinearFit()
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var <= 1e-12 * max(1.0, mean_x * mean_x):
            # Every observation at one x: keep the prior's slope (or none).
            slope = self._prior.slope if self._prior is not None else 0.0
        else:
            slope = (self._xy / self._w - mean_x * mean_y) / var
        slope = max(0.0, slope)
        intercept = mean_y - slope * mean_x
        if intercept < 0:
            # A line through the origin fits better than a negative fixed cost.
            intercept = 0.0
            slope = self._xy / self._xx if self._xx > 0 else 0.0
        return LinearFit(intercept=intercept, slope=max(0.0, slope))


@dataclass(frozen=True)
class BatchObservation:
    """One finished batch, as the worker saw it."""

    size: int
    cost: int  # sum of the items' costs
    work: float  # what the model computed (padded cost for a padded model)
    latency_s: float
    ended_s: float
    job_latency_s: Sequence[float] = ()  # accepted -> finished, per job
    peak_memory_bytes: float | None = None  # measured (a GPU); None: use the declared estimate
    lanes: Sequence[str] = ()  # the lanes of its items
    # The batch was split (out of memory, or bisected around a failing input):
    # its latency and peak are not those of its work, so they are not learned.
    split: bool = False


@dataclass
class SchedulerState:
    """What one model's batcher has learned and counts, beside its ``tuning``: the latency
    and memory fits over a batch's work, the wait window and target cost they set, the
    memory ceiling (lowered by each out-of-memory, raised again after clean batches), the
    arrivals since the running batch started, and when an urgent item was last seen. The
    ``observe_*`` methods update it; :meth:`profile` turns it into the policy's
    :class:`~scheduler.policy.Profile`."""

    tuning: Tuning
    latency: OnlineFit = field(default_factory=OnlineFit)
    memory: OnlineFit = field(default_factory=OnlineFit)
    window_s: float | None = None
    target_cost: float = INF
    memory_ceiling: float = INF
    last_batch_end_s: float | None = None
    avg_batch_s: float | None = None
    batches: int = 0
    arrived_cost: int = 0  # since the running batch started
    ooms: int = 0
    clean_batches: int = 0  # since the last out-of-memory
    batches_since_bulk: int = 0
    mean_cost: float | None = None  # of recent arrivals (moving average)
    last_urgent_s: float | None = None  # when an urgent item was last seen

    def __post_init__(self) -> None:
        self.memory_ceiling = self.tuning.memory_budget_bytes * self.tuning.memory_threshold

    @classmethod
    def create(
        cls,
        tuning: Tuning,
        latency_prior: LinearFit | None = None,
        memory_prior: LinearFit | None = None,
        prior_span: float = 1.0,
    ) -> SchedulerState:
        return cls(
            tuning=tuning,
            latency=OnlineFit(latency_prior, tuning.learning_forget, prior_span),
            memory=OnlineFit(memory_prior, tuning.learning_forget, prior_span),
        )

    # --- observations ----------------------------------------------------------

    def observe_arrival(self, cost: int, lane: str | None = None, now: float | None = None) -> None:
        """An item was seen for the first time (see :meth:`batch_started`).

        Pass its ``lane`` (and the time, ``now``) so that urgent traffic bounds
        the batches (``Tuning.urgent_guard``); without ``now`` the last batch's
        end stands in for it.
        """
        self.arrived_cost += cost
        self.mean_cost = cost if self.mean_cost is None else 0.99 * self.mean_cost + 0.01 * cost
        if lane == Lane.URGENT:
            seen = now if now is not None else self.last_batch_end_s
            if seen is not None:
                self.last_urgent_s = seen

    def batch_started(self) -> None:
        """Fold the cost that arrived since the last batch started into the target.

        That cost is the demand of one batch cycle at the current load; the
        target follows it smoothly (history weight 0.7) so batches do not
        oscillate.
        """
        t = self.tuning
        if self.batches:
            demand = float(max(self.arrived_cost, 1))
            history = demand if math.isinf(self.target_cost) else self.target_cost
            self.target_cost = min(
                t.cost_cap,
                t.batch_cost_history_weight * history + (1 - t.batch_cost_history_weight) * demand,
            )
        self.arrived_cost = 0

    def observe_batch(self, seen: BatchObservation) -> None:
        t = self.tuning
        self.batches += 1
        self.last_batch_end_s = seen.ended_s
        self.batches_since_bulk = 0 if Lane.BULK in seen.lanes else self.batches_since_bulk + 1
        if seen.split:
            return
        self.latency.observe(seen.work, seen.latency_s)
        if seen.peak_memory_bytes is not None:
            self.memory.observe(seen.work, seen.peak_memory_bytes)
        self._relax_ceiling()
        self.avg_batch_s = (
            seen.latency_s
            if self.avg_batch_s is None
            else 0.8 * self.avg_batch_s + 0.2 * seen.latency_s
        )
        if self.window_s is None:
            self.window_s = t.batch_window_start_factor * self.avg_batch_s
        elif seen.job_latency_s:
            observed = sum(seen.job_latency_s) / len(seen.job_latency_s)
            target = self.latency_target_s
            if observed > t.latency_high_factor * target:
                self.window_s *= t.batch_window_shrink
            elif observed < t.latency_low_factor * target:
                self.window_s *= t.batch_window_grow
        low_s, high_s = t.batch_window_min_ms / 1e3, t.batch_window_max_ms / 1e3
        self.window_s = min(high_s, max(low_s, self.window_s))

    def observe_oom(self, work: float) -> None:
        """A batch of this much work ran out of memory: never predict that much again."""
        self.ooms += 1
        predicted = self.memory.fit()(work) if self.memory.known else INF
        if math.isinf(predicted) or predicted <= 0:
            # Nothing to scale: cap the work itself through a flat prediction.
            self.memory = OnlineFit(LinearFit(0.0, 1.0), self.tuning.learning_forget)
            predicted = work
        self.memory_ceiling = min(self.memory_ceiling, predicted * self.tuning.oom_backoff)
        self.clean_batches = 0

    def _relax_ceiling(self) -> None:
        """After enough clean batches, let a lowered ceiling creep back up.

        An out-of-memory may have been transient (another process held memory
        for a while); a ceiling that only ever fell would cost throughput for
        the rest of the process.
        """
        full = self.tuning.memory_budget_bytes * self.tuning.memory_threshold
        if self.memory_ceiling >= full:
            return
        self.clean_batches += 1
        if self.clean_batches >= CEILING_RELAX_AFTER:
            self.clean_batches = 0
            self.memory_ceiling = min(full, self.memory_ceiling * CEILING_RELAX_STEP)

    # --- derived ---------------------------------------------------------------

    @property
    def max_batch_size(self) -> int:
        """``batch_max_size``, or when unset the size derived from what is learned."""
        t = self.tuning
        if t.batch_max_size is not None:
            return t.batch_max_size
        work_cap = min(t.cost_cap, self.memory.fit().inverse(self.memory_ceiling))
        return derived_batch_size(self.latency.fit(), work_cap, self.mean_cost or 1.0)

    @property
    def latency_target_s(self) -> float:
        if self.tuning.latency_target_ms is not None:
            return self.tuning.latency_target_ms / 1e3
        return 3.0 * (self.avg_batch_s or 0.0)

    def profile(self, now: float) -> Profile:
        t = self.tuning
        window = self.window_s if self.window_s is not None else t.batch_window_min_ms / 1e3
        idle = self.last_batch_end_s is None or now - self.last_batch_end_s >= max(window, 1e-3)
        max_batch_size = self.max_batch_size
        return Profile(
            max_batch_size=max_batch_size,
            window_s=window,
            max_batch_cost=t.cost_cap,
            target_cost=self.target_cost,
            padded=t.padded,
            latency=self.latency.fit(),
            memory=self.memory.fit(),
            memory_limit=self.memory_ceiling,
            # Reserved only while bulk items are pending; otherwise unused.
            bulk_slots=math.ceil(t.bulk_share * max_batch_size),
            idle=idle,
            idle_queue=t.idle_queue_max,
            min_efficiency=t.batch_min_efficiency,
            bulk_turn=t.bulk_share > 0 and self.batches_since_bulk >= math.ceil(1 / t.bulk_share),
            bulk_ride_factor=t.bulk_ride_factor,
            **self._urgent_bounds(now),
        )

    def urgent_about(self, now: float) -> bool:
        """Whether urgent work arrived within ``urgent_memory_s``."""
        return self.last_urgent_s is not None and now - self.last_urgent_s <= (
            self.tuning.urgent_memory_s
        )

    def _urgent_bounds(self, now: float) -> dict[str, float]:
        """``max_batch_s`` and ``urgent_latency_s`` while urgent traffic is about."""
        t = self.tuning
        if (
            self.last_urgent_s is None
            or now - self.last_urgent_s > t.urgent_memory_s
            or not self.latency.known
        ):
            return {}
        fit = self.latency.fit()
        cost = max(self.mean_cost or 1.0, 1.0)
        lone_s = fit(cost)  # one item of the usual cost, alone (padded or not: same work)
        if lone_s <= 0:
            return {}
        return {
            "max_batch_s": t.urgent_guard * lone_s,
            "urgent_latency_s": t.urgent_budget * lone_s,
        }
