"""The batching the peers do, for comparison: none, and fixed size plus fixed delay.

Triton's dynamic batcher, Ray Serve's ``@serve.batch`` and TorchServe all batch
this way: first come first served, dispatch when ``max_size`` items are
waiting or the oldest has waited ``max_delay_s``. No lanes, no deadlines, no
cost. Ferry's benchmarks and its ``scheduler`` setting use these.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.policy import BatchDecision, PendingItem
from scheduler.vocabulary import Trigger


def decide_fixed(
    pending: Iterable[PendingItem], max_size: int, max_delay_s: float, now: float
) -> BatchDecision:
    live = sorted(pending, key=lambda item: item.arrival_s)
    if not live:
        return BatchDecision()
    if len(live) >= max_size:
        return BatchDecision(run=tuple(live[:max_size]), trigger=Trigger.SIZE)
    waited = now - live[0].arrival_s
    if waited >= max_delay_s:
        return BatchDecision(run=tuple(live), trigger=Trigger.TIME)
    return BatchDecision(wait_s=max_delay_s - waited)


def decide_single(pending: Iterable[PendingItem], now: float) -> BatchDecision:
    """No batching: the oldest item runs alone, at once."""
    del now
    oldest = min(pending, key=lambda item: item.arrival_s, default=None)
    if oldest is None:
        return BatchDecision()
    return BatchDecision(run=(oldest,), trigger=Trigger.SINGLE)
