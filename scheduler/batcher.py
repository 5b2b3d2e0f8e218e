"""The worker's scheduler: what is pending, whose turn it is, what has been learned.

A :class:`Batcher` is the one stateful piece of scheduling, shaped like
vLLM's engine scheduler: the worker :meth:`~Batcher.add`\\ s what it reads,
asks :meth:`~Batcher.schedule` what to do at a time (and, while the device
is busy, whether the next batch can be prepared ahead), and reports back
what happened: :meth:`~Batcher.started`, :meth:`~Batcher.finished`,
:meth:`~Batcher.out_of_memory`. It never reads a clock: every time comes in
an argument, so the simulator (``bench/simulate.py``) drives the very same
object on a virtual clock.

Each pending item carries a payload of the caller's (the worker's stream
entry, the simulator's job), handed back when the item leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from scheduler.baselines import decide_fixed, decide_single
from scheduler.learning import BatchObservation, SchedulerState
from scheduler.policy import BatchDecision, PendingItem, decide
from scheduler.vocabulary import BATCH_SIZE_FLOOR, PolicyKind, Trigger, batch_work

T = TypeVar("T")

Policy = Callable[[Sequence[PendingItem], float], BatchDecision]
NOTHING = BatchDecision()


def policy_for(kind: PolicyKind | str, state: SchedulerState, fixed_max_delay_s: float) -> Policy:
    """The decision function of ``kind``, over ``state``'s learned profile for Ferry's own."""
    try:
        kind = PolicyKind(kind)
    except ValueError:
        raise ValueError(f"unknown scheduler {kind!r} (ferry, fixed or none)") from None
    if kind is PolicyKind.FERRY:
        return lambda items, now: decide(items, state.profile(now), now)
    if kind is PolicyKind.FIXED:
        # The peers' batching knows nothing of the model: unset, their usual 32.
        size = state.tuning.batch_max_size or BATCH_SIZE_FLOOR
        return lambda items, now: decide_fixed(items, size, fixed_max_delay_s, now)
    return decide_single


class Batcher(Generic[T]):
    """One worker's pending items, the tenants' turns and the learned state of its model.

    ``state``: what is learned about the model (:class:`SchedulerState`);
    ``kind``: the batching applied; ``fixed_max_delay_s``: the ``fixed``
    batching's delay.
    """

    def __init__(
        self,
        state: SchedulerState,
        kind: PolicyKind | str = PolicyKind.FERRY,
        fixed_max_delay_s: float = 0.005,
    ) -> None:
        self._policy = policy_for(kind, state, fixed_max_delay_s)
        self.state = state
        self.kind = PolicyKind(kind)
        self._pending: dict[str, tuple[PendingItem, T]] = {}
        # Per tenant, the number of the batch that last ran one of its items
        # (tenants are taken in turn, least recently served first).
        self._served: dict[str, int] = {}
        self._batches = 0

    # --- what is pending -------------------------------------------------------

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._pending

    def payloads(self) -> list[T]:
        """The payloads of every pending item, in the order they were added."""
        return [payload for _, payload in self._pending.values()]

    def pending(self) -> dict[str, T]:
        """Pending payloads by key (a copy)."""
        return {key: payload for key, (_, payload) in self._pending.items()}

    def add(self, item: PendingItem, payload: T, now: float) -> bool:
        """Hold ``item`` (seen at ``now``); False, and nothing learned, if it is held already."""
        if item.key in self._pending:
            return False
        self._pending[item.key] = (item, payload)
        self.state.observe_arrival(item.cost, item.lane, now)
        return True

    def remove(self, keys: Iterable[str]) -> list[T]:
        """Let go of items that will not run here (taken over, pinned elsewhere); no learning."""
        return [self._pending.pop(key)[1] for key in keys if key in self._pending]

    def clear(self) -> None:
        """Forget everything pending (the caller reads it all again)."""
        self._pending.clear()

    # --- deciding --------------------------------------------------------------

    def schedule(
        self,
        now: float,
        *,
        busy_until: float | None = None,
        runnable: Callable[[T], bool] | None = None,
    ) -> BatchDecision:
        """What to do at ``now`` with the items ``runnable`` accepts (all, if None).

        With the device busy until ``busy_until``, the answer is the batch to
        prepare while it computes, decided for the time it is expected to be
        free, and only when waiting could not change it (its trigger is an
        ``ahead`` one); otherwise nothing (the caller lands the batch on the
        device and asks again). Items are expired only against ``now``, never
        ahead of time.
        """
        items = self._items(runnable)
        if busy_until is None:
            return self._policy(items, now)
        ahead = self._policy(items, max(now, busy_until))
        if ahead.run and ahead.trigger is not None and Trigger(ahead.trigger).ahead:
            return dataclasses.replace(ahead, expire=())
        return NOTHING

    def expired(self, decision: BatchDecision) -> list[T]:
        """The items the decision expires leave; their payloads, in order."""
        return [self._pending.pop(item.key)[1] for item in decision.expire]

    def started(self, decision: BatchDecision) -> list[T]:
        """The decision's batch goes to the device; its payloads, in the batch's order.

        Its items leave the pending set, their tenants' turns move on, and
        the cost that arrived since the last batch started is folded into the
        target cost.
        """
        payloads = [self._pending.pop(item.key)[1] for item in decision.run]
        for item in decision.run:
            self._served[item.tenant] = self._batches
        self._batches += 1
        if len(self._served) > 2 * len(self._pending) + 1000:
            # Forget tenants with nothing pending: they come back as never served.
            waiting = {item.tenant for item, _ in self._pending.values()}
            self._served = {t: n for t, n in self._served.items() if t in waiting}
        self.state.batch_started()
        return payloads

    # --- what happened ---------------------------------------------------------

    def finished(self, seen: BatchObservation) -> None:
        """A batch ran: learn its latency, its memory and the jobs' latencies."""
        self.state.observe_batch(seen)

    def out_of_memory(self, costs: Sequence[int]) -> None:
        """A batch of these costs ran out of memory: never predict that much again."""
        self.state.observe_oom(self.work(costs))

    def work(self, costs: Sequence[int]) -> float:
        return batch_work(costs, self.state.tuning.padded)

    def learn_from(self, other: Batcher[Any]) -> None:
        """Schedule with ``other``'s state and policy from now on (a new version's, learned
        from its own calibration); what is pending and the tenants' turns stay."""
        self.state = other.state
        self.kind = other.kind
        self._policy = other._policy

    def _items(self, runnable: Callable[[T], bool] | None) -> list[PendingItem]:
        served = self._served
        return [
            PendingItem(
                item.key,
                item.lane,
                item.cost,
                item.arrival_s,
                item.deadline_s,
                item.tenant,
                served.get(item.tenant, -1),
            )
            for item, payload in self._pending.values()
            if runnable is None or runnable(payload)
        ]
