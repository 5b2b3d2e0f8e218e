"""How many workers a model wants: ``ferry_model_desired_workers``.

From three things Ferry already knows: the jobs arriving per second
(``lambda``, the model's enqueue counter over a window), the jobs one worker
finishes per second (``mu``, from the batch size and latency the workers
publish), and the queue now with the nearest deadline in it. With ``c``
workers the utilisation is ``rho = lambda / (c * mu)``; keeping it at or
below a target under 1 keeps the queue short (as ``rho`` nears 1 the wait
grows without bound), so ``c >= lambda / (target * mu)``. On top, what is
queued already must drain before the nearest deadline in the queue (Little's
law turned around: ``B`` jobs at ``mu`` per worker take ``B / (c * mu)``
seconds), which asks ``B / (mu * H)`` more workers for a horizon ``H``.

The figure rises at once and falls only after it has stayed lower for the
cool-down, so an autoscaler following it does not flap.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Demand:
    arrival_rate: float  # jobs per second arriving
    backlog: int  # jobs queued or running now
    per_worker_rate: float | None  # jobs per second one worker finishes (None: not learned yet)
    horizon_s: float  # the time the backlog may take: the nearest deadline, at most the drain
    # A backfill's lines waiting: they ask for one worker, not more (the feeder keeps the
    # bulk lane as full as workers drain it, so its size says nothing about demand).
    bulk_backlog: int = 0


def workers_needed(demand: Demand, target_utilisation: float) -> float:
    """The workers (unrounded) that keep rho at the target and drain the backlog in time."""
    busy = demand.arrival_rate > 0 or demand.backlog > 0 or demand.bulk_backlog > 0
    if not demand.per_worker_rate or demand.per_worker_rate <= 0:
        # Nothing learned yet: one worker to learn from, if there is work.
        return 1.0 if busy else 0.0
    steady = demand.arrival_rate / (target_utilisation * demand.per_worker_rate)
    drain = demand.backlog / (demand.per_worker_rate * max(demand.horizon_s, 1e-3))
    return max(steady + drain, 1.0 if demand.bulk_backlog > 0 else 0.0)


class DesiredWorkers:
    """One model's desired workers, from samples taken as they come (each scrape).

    ``window_s``: the span the arrival rate is measured over. ``cooldown_s``:
    how long a lower figure must hold before the answer falls to it.
    """

    def __init__(self, target_utilisation: float, window_s: float, cooldown_s: float) -> None:
        if not 0 < target_utilisation < 1:
            raise ValueError("target_utilisation must be between 0 and 1")
        self.target = target_utilisation
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self._arrivals: deque[tuple[float, int]] = deque()
        self._needs: deque[tuple[float, int]] = deque()
        self.arrival_rate = 0.0
        self.needed = 0.0

    def rate(self, now: float, arrived_total: int) -> float:
        """Jobs per second arriving, from the model's enqueue counter over the window."""
        if self._arrivals and arrived_total < self._arrivals[-1][1]:
            self._arrivals.clear()  # the counter started again (Redis lost it)
        self._arrivals.append((now, arrived_total))
        # Keep one sample at or before the window's start, so the span covers the window.
        while len(self._arrivals) > 2 and self._arrivals[1][0] <= now - self.window_s:
            self._arrivals.popleft()
        first_at, first = self._arrivals[0]
        span = now - first_at
        return (arrived_total - first) / span if span > 0 else 0.0

    def observe(
        self,
        now: float,
        arrived_total: int,
        backlog: int,
        per_worker_rate: float | None,
        horizon_s: float,
        bulk_backlog: int = 0,
    ) -> int:
        """The desired workers now: up at once, down after the cool-down. ``backlog``: the
        live lanes' jobs queued or running; ``bulk_backlog``: the bulk lane's."""
        self.arrival_rate = self.rate(now, arrived_total)
        self.needed = workers_needed(
            Demand(self.arrival_rate, backlog, per_worker_rate, horizon_s, bulk_backlog),
            self.target,
        )
        # A hair under a whole number is that number (floating point, not demand).
        need = math.ceil(self.needed - 1e-9)
        while self._needs and self._needs[-1][1] <= need:
            self._needs.pop()  # a later, higher need outlasts it
        self._needs.append((now, need))
        while self._needs[0][0] < now - self.cooldown_s:
            self._needs.popleft()
        return self._needs[0][1]
