"""A worker's intake: entries read from its model's streams into the batcher.

It reads what fits (``prefetch``), keeps what it holds its own while it
waits (the entries' idle time in Redis), takes over what a dead worker left
behind, and remembers which entries are on their way through the device, so
that reading this consumer's backlog again does not hand them out twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

from core.streams.protocol import JobMessage
from scheduler import Batcher, PendingItem
from workers.gpu.consumer import Entry, StreamConsumer
from workers.gpu.events import BatchObserver

MIN_UPKEEP_S = 0.5
# With the prefetch full of lower lanes, up to this many urgent and vip entries are still
# held besides: read at every step, they run next instead of once the prefetch drains.
PRIORITY_LANES = ("urgent", "vip")
PRIORITY_ROOM = 8


def entry_key(entry: Entry) -> str:
    return entry.entry_id + "@" + entry.stream


def pending_item(key: str, message: JobMessage) -> PendingItem:
    """What the scheduler knows of a job: its lane, cost, times and tenant."""
    return PendingItem(
        key=key,
        lane=message.lane,
        cost=message.cost,
        arrival_s=message.enqueued_at_ms / 1000.0,
        deadline_s=message.deadline_at_ms / 1000.0 if message.deadline_at_ms is not None else None,
        tenant=message.tenant or "",
    )


@dataclass(eq=False)
class Intake:
    """Reads ``consumer``'s streams into ``batcher``; holds at most ``prefetch`` entries."""

    consumer: StreamConsumer
    batcher: Batcher[Entry]
    observer: BatchObserver
    _: KW_ONLY
    prefetch: int
    visibility_timeout_s: float
    clock: Callable[[], float] = time.time
    # Entries taken into a batch and not yet acknowledged (on the device,
    # being recorded): reading this consumer's backlog again returns them.
    running: set[str] = field(init=False, repr=False, default_factory=set)
    _last_upkeep: float = field(init=False, repr=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        # At least one full batch, or a batch could never fill.
        self.prefetch = max(self.prefetch, self.batcher.state.tuning.most_batch_items)

    def fill(self, block_ms: int | None) -> None:
        """Read what fits, waiting up to ``block_ms`` for something to arrive."""
        room = self.prefetch - len(self.batcher)
        if room <= 0:
            held = sum(1 for e in self.batcher.payloads() if e.message.lane in PRIORITY_LANES)
            if held < PRIORITY_ROOM:
                self.take(self.consumer.read_lanes(PRIORITY_LANES, PRIORITY_ROOM - held))
            # Nothing else may be read: wait as the policy asked rather than spin.
            if block_ms:
                time.sleep(block_ms / 1000.0)
            return
        self.take(self.consumer.read(room, block_ms))

    def take(self, entries: Iterable[Entry]) -> None:
        """Hold entries read, except those already held (a re-read returns them again)."""
        now = self.clock()
        for entry in entries:
            key = entry_key(entry)
            if key not in self.running:
                self.batcher.add(pending_item(key, entry.message), entry, now)

    def upkeep(self) -> None:
        """Keep held entries ours, and take over those a dead worker left behind."""
        now = time.monotonic()
        if now - self._last_upkeep < max(MIN_UPKEEP_S, self.visibility_timeout_s / 4):
            return
        self._last_upkeep = now
        lost = self.consumer.touch(self.batcher.payloads())
        # Another worker took them over while this one stalled: they are theirs now.
        self.batcher.remove(entry_key(entry) for entry in lost)
        room = self.prefetch - len(self.batcher)
        if room <= 0:
            return
        reclaimed = self.consumer.reclaim(int(self.visibility_timeout_s * 1000), room)
        self.observer.entries_reclaimed(len(reclaimed))
        self.take(reclaimed)

    def started(self, entries: Iterable[Entry]) -> None:
        """These entries went into a batch: not to be taken again until acknowledged."""
        self.running.update(entry_key(entry) for entry in entries)

    def acknowledge(self, entries: list[Entry], publish: tuple[str, str] | None = None) -> None:
        """Acknowledge the entries (and publish ``publish`` in the same round trip)."""
        self.consumer.ack(entries, publish=publish)
        self.running.difference_update(entry_key(entry) for entry in entries)

    def reread(self) -> None:
        """Forget what is held: it is all read again (after Redis or the database came back)."""
        self.batcher.clear()
        self.running.clear()
        self.consumer.reread_pending()
