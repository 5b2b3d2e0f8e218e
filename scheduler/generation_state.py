"""The generation scheduler's bookkeeping: the KV block pool, each sequence's progress,
and the order in which running sequences are preempted."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.generation_plan import GenerationRequest
from scheduler.vocabulary import RANK, Lane

NEVER = -1  # the admission number of a tenant never admitted (it goes first)


class BlockPool:
    """The free list of KV block ids ``0 .. count - 1``, who holds each taken one, and the
    prompt prefixes whose keys and values blocks still hold (prefix caching).

    Blocks are handed out from the front of the free list and come back at
    its end (a sequence's last block first), so the ids a plan names depend
    only on the calls made. A block
    whose keys and values are a full block of some prompt's prefix is
    registered under that prefix's hash (:func:`prefix_hashes`); a later
    request with the same prefix takes it again instead of computing it: a
    block in use is shared (its holders only read it: a sequence writes only
    past its prefix), and a free one keeps its contents until it is handed
    out for something else, the least recently freed first.
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("a block pool needs at least one block")
        self.capacity = count
        # An ordered set: blocks leave from the front, come back at the end, and one
        # taken again for its prefix leaves from where it is.
        self._free: dict[int, None] = dict.fromkeys(range(count))
        self._holders: dict[int, list[str]] = {}
        self._cached: dict[int, int] = {}  # prefix hash -> block
        self._hash_of: dict[int, int] = {}  # block -> its prefix hash

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._holders)

    @property
    def cached(self) -> int:
        """Blocks holding a registered prefix, in use or free."""
        return len(self._hash_of)

    def hits(self, prefix: Sequence[int]) -> list[int]:
        """The blocks of ``prefix``'s leading hashes that are cached, in order."""
        found = []
        for hashed in prefix:
            block = self._cached.get(hashed)
            if block is None:
                break
            found.append(block)
        return found

    def needed(
        self, count: int, prefix: Sequence[int] = (), leaving: Iterable[SequenceState] = ()
    ) -> int:
        """The free blocks :meth:`take` of ``count`` with ``prefix`` would use (once the
        ``leaving`` sequences gave theirs back: a hit only they hold is free by then)."""
        owners = {s.id for s in leaving}
        hits = self.hits(prefix[:count])
        return count - sum(
            1
            for block in hits
            if block in self._holders and not owners.issuperset(self._holders[block])
        )

    def freed_by(self, leaving: Iterable[SequenceState]) -> int:
        """The blocks that would be free once the ``leaving`` sequences gave theirs back (a
        block shared with another holder stays taken)."""
        sequences = list(leaving)
        owners = {s.id for s in sequences}
        blocks = {block for s in sequences for block in s.blocks}
        return sum(1 for block in blocks if owners.issuperset(self._holders[block]))

    def take(self, owner: str, count: int, prefix: Sequence[int] = ()) -> tuple[int, ...]:
        """``count`` blocks for ``owner``, the first of them those of ``prefix``'s hashes
        that are cached (as many as :meth:`hits` names); ValueError if too few are free."""
        hits = self.hits(prefix[:count])
        needed = self.needed(count, prefix)
        if needed > len(self._free):
            raise ValueError(f"{owner}: {needed} blocks asked, {len(self._free)} free")
        for block in hits:
            self._free.pop(block, None)
        fresh = []
        for _ in range(count - len(hits)):
            block = next(iter(self._free))
            del self._free[block]
            hashed = self._hash_of.pop(block, None)
            if hashed is not None:  # its old prefix is overwritten from now on
                del self._cached[hashed]
            fresh.append(block)
        blocks = (*hits, *fresh)
        for block in blocks:
            self._holders.setdefault(block, []).append(owner)
        return blocks

    def register(self, block: int, hashed: int) -> None:
        """``block`` now holds the full prefix block ``hashed``: later prompts may share it.
        A prefix cached in another block already stays there."""
        if hashed not in self._cached and block not in self._hash_of:
            self._cached[hashed] = block
            self._hash_of[block] = hashed

    def forget(self, blocks: Iterable[int]) -> None:
        """Share none of ``blocks`` from now on (what they hold is suspect)."""
        for block in blocks:
            hashed = self._hash_of.pop(block, None)
            if hashed is not None:
                del self._cached[hashed]

    def give_back(self, owner: str, blocks: Iterable[int]) -> None:
        """Return ``owner``'s blocks; ValueError for a block it does not hold."""
        blocks = tuple(blocks)
        for block in blocks:
            if owner not in self._holders.get(block, ()):
                held = self._holders.get(block)
                raise ValueError(
                    f"{owner} returns block {block}, held by {', '.join(held) if held else None}"
                )
        # Last block first: a sequence's tail is handed out again before its prefix,
        # which a later prompt may share.
        for block in reversed(blocks):
            holders = self._holders[block]
            holders.remove(owner)
            if not holders:
                del self._holders[block]
                self._free[block] = None

    def owners(self) -> Mapping[str, tuple[int, ...]]:
        """Every taken block by its holders, in the order taken (a shared block under each)."""
        held: dict[str, list[int]] = {}
        for block, owners in self._holders.items():
            for owner in owners:
                held.setdefault(owner, []).append(block)
        return {owner: tuple(blocks) for owner, blocks in held.items()}


def prefix_hashes(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """One hash for each full block of ``tokens``, each covering every token up to its
    block's end (two prompts share block ``i``'s hash only if their first ``(i + 1) *
    block_size`` tokens are the same): what :class:`BlockPool` caches blocks under."""
    hashes = []
    digest = hashlib.blake2b(digest_size=16)
    for end in range(block_size, len(tokens) + 1, block_size):
        digest.update(b"".join(t.to_bytes(4, "little") for t in tokens[end - block_size : end]))
        hashes.append(int.from_bytes(digest.copy().digest(), "little"))
    return tuple(hashes)


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
    registered: int = 0  # its prefix blocks registered in the pool (their KV computed)

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
