"""The generation scheduler's bookkeeping: the KV block pool, each sequence's progress,
and the order in which running sequences are preempted."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.generation_plan import GenerationRequest
from scheduler.vocabulary import RANK, Lane

NEVER = -1  # the admission number of a tenant never admitted (it goes first)


class BlockPool:
    """The free list of KV block ids ``0 .. count - 1`` and who holds each taken one.

    Blocks are handed out from the front of the free list and come back at
    its end, so the ids a plan names depend only on the calls made.
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("a block pool needs at least one block")
        self.capacity = count
        self._free: deque[int] = deque(range(count))
        self._owner: dict[int, str] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._owner)

    def take(self, owner: str, count: int) -> tuple[int, ...]:
        """``count`` blocks for ``owner``; ValueError if fewer are free."""
        if count > len(self._free):
            raise ValueError(f"{owner}: {count} blocks asked, {len(self._free)} free")
        blocks = tuple(self._free.popleft() for _ in range(count))
        for block in blocks:
            self._owner[block] = owner
        return blocks

    def give_back(self, owner: str, blocks: Iterable[int]) -> None:
        """Return ``owner``'s blocks; ValueError for a block it does not hold."""
        blocks = tuple(blocks)
        for block in blocks:
            if self._owner.get(block) != owner:
                raise ValueError(f"{owner} returns block {block}, held by {self._owner.get(block)}")
        for block in blocks:
            del self._owner[block]
            self._free.append(block)

    def owners(self) -> Mapping[str, tuple[int, ...]]:
        """Every taken block by its holder, in the order taken."""
        held: dict[str, list[int]] = {}
        for block, owner in self._owner.items():
            held.setdefault(owner, []).append(block)
        return {owner: tuple(blocks) for owner, blocks in held.items()}


@dataclass(eq=False)
class SequenceState:
    """One request's progress through the scheduler.

    ``generated``: tokens sampled so far. ``computed``: known tokens whose KV
    the runtime holds (0 while waiting). ``prefilling``: it has not sampled
    since it was last admitted, so it takes chunks, not decodes.
    ``admitted_at`` / ``first_admitted``: the numbers of its latest and its
    first admission (``NEVER`` before either); the most recently admitted is
    preempted first, the first admitted resumes first. ``cancelled``: cancel
    was asked while it ran; it is released at the next schedule. ``alone``: a
    suspect (it was in a step the runtime failed): until it samples a token
    again it runs only with no other sequence running, and nothing is
    admitted beside it.
    """

    request: GenerationRequest
    lane: Lane
    generated: int = 0
    computed: int = 0
    prefilling: bool = True
    blocks: tuple[int, ...] = ()
    admitted_at: int = NEVER
    first_admitted: int = NEVER
    cancelled: bool = False
    alone: bool = False

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def rank(self) -> int:
        return RANK[self.lane]

    @property
    def started(self) -> bool:
        """Admitted at least once (so the runtime knows it)."""
        return self.first_admitted != NEVER

    @property
    def known(self) -> int:
        """Prompt plus what it generated."""
        return self.request.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.request.max_tokens - self.generated

    @property
    def to_prefill(self) -> int:
        """Known tokens still without KV while it prefills (0 once it decodes)."""
        return self.known - self.computed if self.prefilling else 0

    @property
    def deadline(self) -> float:
        deadline = self.request.deadline
        return float("inf") if deadline is None else deadline


def preemption_order(running: Iterable[SequenceState], below_rank: int) -> list[SequenceState]:
    """The running sequences an arrival of rank ``below_rank`` may evict, first victim first:
    strictly lower lanes only, the lowest lane first, the most recently admitted first."""
    victims = [s for s in running if s.rank > below_rank]
    victims.sort(key=lambda s: (-s.rank, -s.admitted_at))
    return victims
