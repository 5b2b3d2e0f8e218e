"""Reading a model's lane streams through the consumer group, and acknowledging."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.exceptions import OutOfMemoryError

from core.streams.protocol import (
    GROUP,
    JobMessage,
    ProtocolError,
    Scripts,
    dead_letter_key,
    is_wake,
    seq_key,
    stream_key,
    tenants_key,
    wake_key,
)
from core.streams.target import is_cluster
from scheduler.vocabulary import LANES

log = logging.getLogger(__name__)

# The dead-letter stream is for inspection, not a queue: keep the newest this many.
DEAD_LETTER_MAXLEN = 100_000
# Redis times out a blocked read only when its cron runs (every 1/hz: 100 ms
# at the default hz 10), so a 5 ms BLOCK can return after 100 ms. Waits this
# short (the scheduler's windows) poll instead, every POLL_S.
PRECISE_BELOW_MS = 250
POLL_S = 0.002
# How often a consumer drops from the lanes' lists the tenants with nothing queued.
PRUNE_S = 5.0


@dataclass(frozen=True)
class Entry:
    stream: str
    entry_id: str
    message: JobMessage


class StreamConsumer:
    """One consumer in the model's group, reading the most urgent lane first.

    Within a lane it reads the tenants' streams in turn, an equal share of
    the room from each (see ``core.streams.protocol``), so a tenant with a backlog
    takes no more of a read than one that has a single job waiting.
    """

    def __init__(self, client: redis.Redis, prefix: str, model: str, consumer: str) -> None:
        self.client = client
        self.prefix = prefix
        self.model = model
        self.consumer = consumer
        self.scripts = Scripts(client)
        self._cluster = is_cluster(client)
        # Per lane: the shared stream, then one per tenant with work (refreshed at each read).
        self.lanes: dict[str, list[str]] = {
            lane: [stream_key(prefix, model, lane)] for lane in LANES
        }
        self.wake = wake_key(prefix, model)
        self._grouped: set[str] = set()  # streams whose group this consumer made or found
        self._turn: dict[str, int] = dict.fromkeys(LANES, 0)  # where each lane's next read starts
        # Per tenant stream: its score (latest enqueue's sequence number) at the
        # last refresh, and the score it had when a read found it drained: it
        # is not asked again until an enqueue changes its score.
        self._scores: dict[str, float] = {}
        self._drained: dict[str, float] = {}
        self._seq: Any = None  # the model's enqueue counter at the last refresh
        self._raw_counts: dict[str, int] = {}  # items per stream in the last XREADGROUP reply
        self._pruned_at = time.monotonic()
        # Entries this consumer name was given before a restart and never
        # acknowledged; they are read again (from id 0) before new ones.
        self._backlog: dict[str, str] = {}
        self._reread = False
        self._woken = False  # a wake-up marker was read

    @property
    def streams(self) -> list[str]:
        """Every stream known to hold the model's work, most urgent lane first."""
        return [stream for lane in LANES for stream in self.lanes[lane]]

    def ensure_groups(self) -> None:
        self._grouped.clear()  # Redis may have lost them (restarted empty)
        self._drained.clear()  # and its sequence numbers with them
        self.refresh()
        self.reread_pending()

    def refresh(self) -> None:
        """Learn which tenants have streams in each lane, and give new streams the group."""
        pipe = self.client.pipeline(transaction=False)
        for lane in LANES:
            pipe.zrange(tenants_key(self.prefix, self.model, lane), 0, -1, withscores=True)
        pipe.get(seq_key(self.prefix, self.model))
        *scored, seq = pipe.execute()
        self._seq = seq
        tenants: dict[str, list[str]] = {}
        self._scores = {}
        for lane, members in zip(LANES, scored, strict=True):
            tenants[lane] = [_text(tenant) for tenant, _score in members]
            shared = stream_key(self.prefix, self.model, lane)
            # The lane's shared stream (jobs without a tenant) scores the model's enqueue
            # sequence, which every enqueue moves, as a tenant's stream scores its last
            # enqueue: found drained, it is not asked again until something was enqueued.
            self._scores[shared] = float(seq) if seq is not None else 0.0
            streams = [shared]
            for tenant, score in members:
                stream = stream_key(self.prefix, self.model, lane, _text(tenant))
                self._scores[stream] = float(score)
                streams.append(stream)
            self.lanes[lane] = streams
        for stream in [*self.streams, self.wake]:
            if stream not in self._grouped:
                if self._create_group(stream):
                    self._grouped.add(stream)
                else:  # not read until it has the group
                    for streams in self.lanes.values():
                        if stream in streams:
                            streams.remove(stream)
        if time.monotonic() - self._pruned_at >= PRUNE_S:
            self._prune(tenants)

    def _create_group(self, stream: str) -> bool:
        """Give ``stream`` the group (False: it has none, and cannot have it now)."""
        try:
            # From id 0, so entries added before any worker started are delivered.
            self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except OutOfMemoryError:
            # Redis at its maxmemory refuses XGROUP CREATE even for a group that exists
            # (the enqueue script gives each tenant's stream its group): look instead.
            try:
                groups: Any = self.client.xinfo_groups(stream)
            except redis.ResponseError:
                groups = []  # no such stream: nothing to read in it
            if _group_named(groups) is not None:
                return True
            if stream == self.wake:
                raise  # read at every wait: the worker waits for memory instead
            return False
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        return True

    def _prune(self, tenants: dict[str, list[str]]) -> None:
        """Drop tenants whose stream is empty from the lanes' lists (their streams stay)."""
        self._pruned_at = time.monotonic()
        pipe = self.client.pipeline(transaction=False)
        for lane, names in tenants.items():
            for tenant in names:
                self.scripts.prune(pipe, self.prefix, self.model, lane, tenant)
        self.scripts.execute(pipe)

    def reread_pending(self) -> None:
        """Read this consumer's unacknowledged entries again, before any new ones."""
        self._reread = True

    def read(self, room: int, block_ms: int | None) -> list[Entry]:
        """Up to ``room`` entries, urgent lane first; blocks only when told to."""
        self.refresh()
        if self._reread:
            self._backlog = dict.fromkeys(self.streams, "0")
            self._reread = False
        entries: list[Entry] = []
        for stream in self.streams:
            if room - len(entries) <= 0:
                return entries
            start = self._backlog.get(stream)
            if start is None:
                continue
            got = self._xread({stream: start}, room - len(entries), None)
            if got:
                self._backlog[stream] = got[-1].entry_id
            else:
                del self._backlog[stream]
            entries.extend(got)
        if self._backlog:
            # New entries only once the old ones are all back in hand, so that
            # an entry is never read twice.
            return entries
        for lane in LANES:
            if room - len(entries) <= 0:
                return entries
            entries.extend(self._read_lane(lane, room - len(entries)))
        if entries or block_ms is None:
            return entries
        # Nothing anywhere: wait on every stream at once. A tenant new to a
        # lane wakes the wait through the wake stream.
        every_lane = dict.fromkeys([*self.streams, self.wake], ">")
        if block_ms >= PRECISE_BELOW_MS:
            self._woken = False
            got = self._xread(every_lane, 1, block_ms)
            if got or not self._woken:
                return got
            # A new tenant: its stream is read now. The markers left are stale
            # (this worker is awake and reads every listed stream).
            self.client.xtrim(self.wake, maxlen=0)
            return self.read(room, None)
        # A short wait polls the model's enqueue counter, one GET, and reads
        # as soon as anything was enqueued.
        deadline = time.monotonic() + block_ms / 1000.0
        seq = seq_key(self.prefix, self.model)
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, POLL_S))
            if self.client.get(seq) != self._seq:
                return self.read(room, None)
        return []

    def read_lanes(self, lanes: tuple[str, ...], room: int) -> list[Entry]:
        """Up to ``room`` new entries of ``lanes`` only (never blocks): what a worker whose
        prefetch is full of lower lanes still reads. Nothing while its backlog is read again
        (that comes first, so that no entry is read twice)."""
        self.refresh()
        if self._reread or self._backlog:
            return []
        entries: list[Entry] = []
        for lane in lanes:
            if room - len(entries) <= 0:
                break
            entries.extend(self._read_lane(lane, room - len(entries)))
        return entries

    def _read_lane(self, lane: str, room: int) -> list[Entry]:
        """Up to ``room`` new entries of the lane, an equal share from each of its streams.

        A stream that has fewer than its share leaves the rest to the others,
        in a further read. Which streams come first turns at every read, so
        the remainder of an uneven share goes to each in turn.
        """
        # Streams found drained and given nothing since are not asked.
        streams = [
            stream
            for stream in self.lanes[lane]
            if stream not in self._scores or self._drained.get(stream) != self._scores[stream]
        ]
        if not streams:
            return []
        turn = self._turn[lane] % len(streams)
        order = streams[turn:] + streams[:turn]
        self._turn[lane] = turn + min(room, len(order))
        entries: list[Entry] = []
        while order and room - len(entries) > 0:
            left = room - len(entries)
            asked = order[:left]  # more streams than room: one each from the first ones
            share = max(1, left // len(asked))
            got = self._xread(dict.fromkeys(asked, ">"), share, None)
            entries.extend(got)
            # What Redis handed over per stream, markers and malformed entries included.
            counts = self._raw_counts
            for stream in asked:
                if counts.get(stream, 0) < share and stream in self._scores:
                    # Fewer than asked: nothing undelivered was left in it.
                    self._drained[stream] = self._scores[stream]
            # Those not asked yet come first; then the streams that filled
            # their share (only they may have more).
            full = [stream for stream in asked if counts.get(stream, 0) >= share]
            order = order[len(asked) :] + full
        return entries

    def reclaim(self, min_idle_ms: int, room: int) -> list[Entry]:
        """Take over entries another consumer read but left unacknowledged for too long.

        XAUTOCLAIM (Redis 6.2+) hands them to this consumer; its attempts
        counter in the database decides whether they run again.
        """
        entries: list[Entry] = []
        for stream in [*self.streams, self.wake]:
            start = "0-0"
            while room - len(entries) > 0:
                reply: Any = self.client.xautoclaim(
                    stream, GROUP, self.consumer, min_idle_ms, start, count=room - len(entries)
                )
                start, claimed = reply[0], reply[1]
                if len(reply) > 2 and reply[2]:
                    # Deleted while pending (Redis 7 reports them): nothing to run.
                    self.client.xack(stream, GROUP, *reply[2])
                entries.extend(self._entries(stream, claimed))
                if start in ("0-0", b"0-0"):
                    break
        if entries:
            log.warning(
                "reclaimed entries another worker left unacknowledged",
                extra={"model": self.model, "count": len(entries)},
            )
        return entries

    def touch(self, entries: list[Entry]) -> list[Entry]:
        """Reset the idle time of the entries still ours; returns those another took over.

        XCLAIM moves an entry to this consumer whoever holds it, so only the
        ones the group still lists under this consumer are touched: an entry
        another worker reclaimed (this one stalled) stays theirs.
        """
        by_stream: dict[str, list[Entry]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry)
        lost: list[Entry] = []
        for stream, held in by_stream.items():
            ours = self._owned(stream, [e.entry_id for e in held])
            mine = [e.entry_id for e in held if e.entry_id in ours]
            lost += [e for e in held if e.entry_id not in ours]
            if mine:
                self.client.xclaim(stream, GROUP, self.consumer, 0, cast(Any, mine), justid=True)
        return lost

    def _owned(self, stream: str, ids: list[str]) -> set[str]:
        low, high = min(ids, key=_id_key), max(ids, key=_id_key)
        reply: Any = self.client.xpending_range(
            stream, GROUP, min=low, max=high, count=len(ids) + 1000, consumername=self.consumer
        )
        return {_text(item["message_id"]) for item in reply}

    def ack(self, entries: list[Entry], publish: tuple[str, str] | None = None) -> None:
        """Acknowledge (and delete) the entries; ``publish``: a (channel, message) sent after
        them in the same round trip."""
        by_stream: dict[str, list[str]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry.entry_id)
        if not by_stream and publish is None:
            return
        # Acknowledged entries are deleted at once, so the streams hold only
        # live work and cannot grow without bound; their inputs leave the queue's
        # byte count with them, in the same script.
        pipe = self.client.pipeline(transaction=False)
        if by_stream:
            size = sum(entry.message.input_bytes for entry in entries)
            self.scripts.ack(pipe, self.prefix, self.model, by_stream, size)
        if publish is not None and not self._cluster:
            pipe.publish(*publish)
        self.scripts.execute(pipe)
        if publish is not None and self._cluster:
            # A Cluster pipeline refuses PUBLISH; any node relays it to the whole cluster.
            self.client.publish(*publish)

    def dead_letter(self, entries: list[Entry]) -> None:
        """Copy entries to the model's dead-letter stream (the caller acknowledges)."""
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            fields = {**entry.message.encode(), "source": entry.stream, "reason": "max_attempts"}
            pipe.xadd(
                dead_letter_key(self.prefix, self.model),
                cast(Any, fields),
                maxlen=DEAD_LETTER_MAXLEN,
                approximate=True,
            )
        pipe.execute()

    def _xread(self, streams: dict[str, str], count: int, block_ms: int | None) -> list[Entry]:
        # redis-py's stubs describe the reply loosely; its shape is fixed by Redis.
        reply: Any
        if self._cluster:
            # A Cluster client would ask a node for an XREADGROUP's keys first (COMMAND
            # GETKEYS, a round trip per read); all of a model's streams share its slot, so
            # the node is named. A MOVED or ASK reply is still followed within the call.
            block = ["BLOCK", block_ms] if block_ms is not None else []
            reply = self.client.execute_command(
                "XREADGROUP",
                "GROUP",
                GROUP,
                self.consumer,
                "COUNT",
                count,
                *block,
                "STREAMS",
                *streams,
                *streams.values(),
                target_nodes=cast(Any, self.client).get_node_from_key(next(iter(streams))),
            )
        else:
            reply = self.client.xreadgroup(
                GROUP, self.consumer, cast(Any, streams), count=count, block=block_ms
            )
        entries: list[Entry] = []
        self._raw_counts = {}
        for stream, items in reply or []:
            self._raw_counts[_text(stream)] = len(items)
            entries.extend(self._entries(stream, items))
        return entries

    def _entries(self, stream: str, items: Any) -> list[Entry]:
        stream = _text(stream)
        entries: list[Entry] = []
        for entry_id, fields in items:
            if entry_id is None:  # Redis 6.2 reports a deleted entry as nil
                continue
            if fields is None:  # deleted while pending
                self.client.xack(stream, GROUP, entry_id)
                continue
            if is_wake(fields):  # its work is the refresh the next read makes
                self._discard(stream, entry_id)
                self._woken = True
                continue
            try:
                message = JobMessage.decode(fields)
            except ProtocolError as exc:
                self._dead_letter(stream, entry_id, fields, str(exc))
                continue
            entries.append(Entry(stream, entry_id, message))
        return entries

    def _discard(self, stream: str, entry_id: str) -> None:
        # No MULTI, which Redis at maxmemory refuses whole: a marker acknowledged but left
        # undeleted is trimmed with the wake stream's oldest.
        pipe = self.client.pipeline(transaction=False)
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    def _dead_letter(self, stream: str, entry_id: str, fields: dict[str, str], why: str) -> None:
        log.error(
            "malformed stream entry dead-lettered",
            extra={"stream": stream, "entry": entry_id, "reason": why},
        )
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(
            dead_letter_key(self.prefix, self.model),
            cast(Any, {**fields, "source": stream, "reason": why}),
            maxlen=DEAD_LETTER_MAXLEN,
            approximate=True,
        )
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()


def _id_key(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _group_named(groups: list[dict[Any, Any]]) -> dict[Any, Any] | None:
    for group in groups:
        name = group.get("name", group.get(b"name"))
        if _text(name) == GROUP:
            return group
    return None
