"""Wait estimates shared by the workers (who learn them) and the API (who quotes them).

After every batch a worker publishes what it has learned about its model into
a Redis hash; the API reads it to put ``estimated_wait_ms`` on each 202 and to
refuse at once a deadline that the queue ahead makes impossible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from scheduler.vocabulary import LANES


@dataclass(frozen=True)
class ModelEstimate:
    """What a model's workers have learned: latency = a + b x work, and the usual batch."""

    latency_a_s: float
    latency_b_s: float
    padded: bool
    max_batch_size: int
    max_batch_cost: float
    mean_cost: float  # the average cost of recent items (0: none seen yet)
    pad_ratio: float = 1.0  # work / sum of costs in recent batches (1 when unpadded)
    window_s: float = 0.0

    def latency_s(self, work: float) -> float:
        return self.latency_a_s + self.latency_b_s * work

    def full_batch(self, item_cost: float) -> int:
        """The items of ``item_cost`` in a full batch (by size, and by cost where capped)."""
        per_batch = self.max_batch_size
        if math.isfinite(self.max_batch_cost):
            per_batch = max(1, min(per_batch, int(self.max_batch_cost // _work(self, item_cost))))
        return per_batch

    def jobs_per_second(self) -> float:
        """One worker's capacity: full batches of the usual job, back to back."""
        item_cost = self.mean_cost if self.mean_cost >= 1 else 1.0
        per_batch = self.full_batch(item_cost)
        return per_batch / max(self.latency_s(_work(self, per_batch * item_cost)), 1e-6)

    def to_hash(self) -> dict[str, str]:
        return {f.name: repr(float(getattr(self, f.name))) for f in fields(self)}

    @classmethod
    def from_hash(cls, raw: Mapping[str, float]) -> ModelEstimate | None:
        """``None`` until a worker has published every field."""
        try:
            values = {f.name: raw[f.name] for f in fields(cls)}
        except KeyError:
            return None
        return cls(
            latency_a_s=values["latency_a_s"],
            latency_b_s=values["latency_b_s"],
            padded=bool(values["padded"]),
            max_batch_size=max(1, int(values["max_batch_size"])),
            max_batch_cost=values["max_batch_cost"],
            mean_cost=values["mean_cost"],
            pad_ratio=max(1.0, values["pad_ratio"]),
            window_s=max(0.0, values["window_s"]),
        )


def estimate_wait_s(est: ModelEstimate, ahead_items: int, cost: int, workers: int = 1) -> float:
    """Accepted -> finished, in seconds, for a job of ``cost`` behind ``ahead_items``.

    The items ahead run in full batches shared among the live workers; then
    the job waits at most one window and runs in a batch with what is left.
    """
    item_cost = est.mean_cost if est.mean_cost >= 1 else float(max(cost, 1))
    per_batch = est.full_batch(item_cost)
    queue_s = (ahead_items / per_batch) * est.latency_s(_work(est, per_batch * item_cost))
    own_items = min(ahead_items + 1, per_batch)
    own_work = _work(est, (own_items - 1) * item_cost + max(cost, 1))
    if est.padded:
        own_work = max(own_work, own_items * cost)  # padded to this job's length at least
    return queue_s / max(workers, 1) + est.window_s + est.latency_s(own_work)


def jobs_ahead(depths: dict[str, dict[str, int]], lane: str, tenant: str) -> int:
    """The jobs that run before a new one of ``tenant`` in ``lane``.

    Every job of a higher lane; in its own lane, the tenant's own queue and,
    as workers take the lane's tenants in turn, as many of each other
    tenant's jobs as its own plus one (a flood of another tenant is not ahead).
    """
    ahead = sum(sum(depths[name].values()) for name in LANES[: LANES.index(lane)])
    own = depths[lane].get(tenant, 0)
    others = sum(min(depth, own + 1) for name, depth in depths[lane].items() if name != tenant)
    return ahead + own + others


def _work(est: ModelEstimate, cost: float) -> float:
    return cost * est.pad_ratio if est.padded else cost
