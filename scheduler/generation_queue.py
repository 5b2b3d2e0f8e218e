"""The generation scheduler's waiting sequences, kept in the order they are admitted.

A step looks only at the head of the queue (admission stops at the first
request that does not fit), so the order is walked lazily: each lane's
preempted sequences, then its tenants turn by turn, each tenant's requests
kept sorted as they arrive. Deadlines sit in a heap, so expiring the due
ones does not scan the queue either.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet

from scheduler.generation_state import NEVER, SequenceState
from scheduler.vocabulary import LANES


def _within_tenant(sequence: SequenceState) -> tuple[float, float, str]:
    return (sequence.deadline, sequence.request.arrival, sequence.id)


def _by_turn(
    queues: list[list[SequenceState]], turn: int, last_admitted: Mapping[str, int]
) -> list[list[SequenceState]]:
    """Tenants' queues in the order their requests of this ``turn`` go."""

    def key(queue: list[SequenceState]) -> tuple[int, float, float, str]:
        head = queue[turn]
        return (last_admitted.get(head.request.tenant, NEVER), *_within_tenant(head))

    return sorted(queues, key=key)


class WaitingQueue:
    """Waiting sequences by id, and the order in which they are admitted (:meth:`order`)."""

    def __init__(self) -> None:
        self._all: dict[str, SequenceState] = {}  # in the order added
        self._resumed: dict[int, list[SequenceState]] = {}  # lane rank -> by first admission
        self._fresh: dict[int, dict[str, list[SequenceState]]] = {}  # rank -> tenant -> sorted
        self._deadlines: list[tuple[float, int, str]] = []  # never admitted ones, lazily pruned
        self._added = 0

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, id: object) -> bool:
        return id in self._all

    def values(self) -> list[SequenceState]:
        return list(self._all.values())

    def add(self, sequence: SequenceState) -> None:
        self._all[sequence.id] = sequence
        self._added += 1
        if sequence.started:
            queue = self._resumed.setdefault(sequence.rank, [])
            bisect.insort(queue, sequence, key=lambda s: s.first_admitted)
            return
        tenants = self._fresh.setdefault(sequence.rank, {})
        bisect.insort(tenants.setdefault(sequence.request.tenant, []), sequence, key=_within_tenant)
        if sequence.request.deadline is not None:
            heapq.heappush(self._deadlines, (sequence.deadline, self._added, sequence.id))

    def remove(self, id: str) -> SequenceState | None:
        sequence = self._all.pop(id, None)
        if sequence is None:
            return None
        if sequence.started:
            self._resumed[sequence.rank].remove(sequence)
        else:
            tenants = self._fresh[sequence.rank]
            queue = tenants[sequence.request.tenant]
            queue.remove(sequence)
            if not queue:
                del tenants[sequence.request.tenant]
        if len(self._deadlines) > 2 * len(self._all) + 64:
            self._deadlines = [entry for entry in self._deadlines if self._holds(entry[2])]
            heapq.heapify(self._deadlines)
        return sequence

    def _holds(self, id: str) -> bool:
        sequence = self._all.get(id)
        return sequence is not None and not sequence.started

    def due(self, before: float) -> list[SequenceState]:
        """Remove and return the never-admitted sequences whose deadline is before ``before``,
        the earliest first."""
        found: list[SequenceState] = []
        while self._deadlines and self._deadlines[0][0] < before:
            _, _, id = heapq.heappop(self._deadlines)
            if self._holds(id):
                sequence = self.remove(id)
                assert sequence is not None
                found.append(sequence)
        return found

    def tenants(self) -> set[str]:
        """The tenants with a request that was never admitted."""
        return {tenant for tenants in self._fresh.values() for tenant in tenants}

    def tenants_by_rank(self) -> list[set[str]]:
        """For each lane rank, the tenants with a sequence waiting in that lane (preempted
        ones included)."""
        found: list[set[str]] = [set() for _ in LANES]
        for rank, tenants in self._fresh.items():
            found[rank].update(tenants)
        for rank, queue in self._resumed.items():
            found[rank].update(sequence.request.tenant for sequence in queue)
        return found

    def others_waiting(self, tenant: str, up_to_rank: int) -> bool:
        """Whether a tenant other than ``tenant`` has a sequence waiting in lane rank
        ``up_to_rank`` or a higher lane (a lower rank)."""
        for rank in range(up_to_rank + 1):
            tenants = self._fresh.get(rank, {})
            if len(tenants) > 1 or (tenants and tenant not in tenants):
                return True
            if any(s.request.tenant != tenant for s in self._resumed.get(rank, ())):
                return True
        return False

    def soonest_deadline(self) -> float:
        """The earliest deadline of a never-admitted sequence (inf: none)."""
        while self._deadlines and not self._holds(self._deadlines[0][2]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else float("inf")

    def order(
        self, last_admitted: Mapping[str, int], skip: AbstractSet[str] = frozenset()
    ) -> Iterator[SequenceState]:
        """The waiting sequences in the order they are admitted, lazily.

        By lane (urgent, vip, normal, bulk). Within a lane, preempted
        sequences first (the first admitted first: they were running and
        hold work done), then the tenants in turn: each tenant's first
        request, then each one's second, and among the requests of one turn
        the tenant admitted least recently (``last_admitted``: its latest
        admission number) first; within a tenant, and for ties, the earliest
        deadline, then arrival, then id. Each lane is read when the walk
        reaches it, so the caller may add and remove between items.
        ``skip``: tenants whose requests are not wanted; the caller may add to it
        during the walk, and their requests not yet reached are left out.
        """
        for rank in range(len(LANES)):
            yield from list(self._resumed.get(rank, ()))
            queues = [list(queue) for queue in self._fresh.get(rank, {}).values()]
            turn = 0
            while queues:
                for queue in _by_turn(queues, turn, last_admitted):
                    if queue[turn].request.tenant not in skip:
                        yield queue[turn]
                turn += 1
                queues = [
                    queue
                    for queue in queues
                    if len(queue) > turn and queue[0].request.tenant not in skip
                ]
