"""Redis key names, the stream message protocol and the enqueue script, in one place.

Every key of one model carries the ``{model}`` hash tag so that all of a model's
streams land in one Redis Cluster slot.

Each lane of a model is a set of streams: one per tenant (API key) with work
in it, listed in the lane's *tenants* sorted set, plus the lane's shared
stream, which holds entries without a tenant. Workers
read a lane's tenants in turn, so one tenant's backlog never stands in front
of another tenant's jobs (see ``workers.gpu.consumer``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from core.streams.target import is_cluster, is_pipeline
from scheduler.vocabulary import LANES, Lane

PROTOCOL_VERSION = 1
GROUP = "workers"


class ProtocolError(ValueError):
    """A stream entry that is not a valid Ferry message."""


def stream_key(prefix: str, model: str, lane: str, tenant: str | None = None) -> str:
    """The lane's stream for ``tenant``; without one, the lane's shared stream."""
    shared = f"{prefix}:{{{model}}}:{lane}"
    return f"{shared}:t:{tenant}" if tenant else shared


def lane_streams(prefix: str, model: str) -> list[str]:
    """The model's shared streams, most urgent lane first."""
    return [stream_key(prefix, model, lane) for lane in LANES]


def wake_key(prefix: str, model: str) -> str:
    """Stream of wake-up markers: a tenant has its first job in a lane."""
    return f"{prefix}:{{{model}}}:wake"


def tenants_key(prefix: str, model: str, lane: str) -> str:
    """Sorted set of the tenants whose stream in the lane may hold entries.

    Each is scored by the model's enqueue sequence number of its latest entry,
    so a reader can tell a stream that has had nothing new since it found it
    drained.
    """
    return f"{prefix}:{{{model}}}:{lane}:tenants"


def bulk_seq_key(prefix: str, model: str) -> str:
    """Counter of the jobs enqueued in the model's bulk lane. The model's arrival rate is
    its live lanes' (the bulk lane is fed as fast as workers drain it): the enqueue
    sequence less this, so a submission to a live lane counts once, in the sequence the
    enqueue script moves anyway, with no counter of its own."""
    return f"{prefix}:{{{model}}}:bulk-seq"


def queued_bytes_key(prefix: str, model: str) -> str:
    """Counter of the input bytes of the model's stream entries: the enqueue scripts add each
    entry's, a worker's acknowledgement takes them off (``FERRY_QUEUE_MAX_BYTES``). Lost and
    begun again with the streams."""
    return f"{prefix}:{{{model}}}:queued-bytes"


def seq_key(prefix: str, model: str) -> str:
    """Counter of the model's enqueues: it changes whenever any of its streams gets an entry."""
    return f"{prefix}:{{{model}}}:seq"


# XADD to the tenant's stream and list the tenant in the lane, atomically, so
# a worker pruning an empty tenant (PRUNE) can never drop one just added to.
# A tenant new to the lane also gets a wake-up marker in the model's wake
# stream, which blocked workers wait on beside the lanes: their reads do not
# include the new stream yet. Markers nobody reads are trimmed. Its stream (and
# the wake stream) gets the workers' group there and then (an error if it has
# one, ignored): a worker that finds the stream later may not be able to make
# it, Redis at its maxmemory refusing XGROUP CREATE, and could then never read
# what fills that memory.
WAKE_FIELD = "wake"
WAKE_MAXLEN = 1000
# Both enqueue scripts end by listing the tenant in its lane at the new sequence (seq):
# a tenant new there gets its wake-up marker and its streams their group.
_LIST_TENANT = f"""
if redis.call('ZADD', KEYS[2], seq, ARGV[1]) == 1 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', '{WAKE_MAXLEN}', '*',
             'v', '{PROTOCOL_VERSION}', '{WAKE_FIELD}', ARGV[1])
  redis.pcall('XGROUP', 'CREATE', KEYS[1], '{GROUP}', '0')
  redis.pcall('XGROUP', 'CREATE', KEYS[3], '{GROUP}', '0')
end
"""
_ENQUEUE = f"""
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
local seq = redis.call('INCR', KEYS[4])
if tonumber(ARGV[2]) > 0 then redis.call('INCRBY', KEYS[5], ARGV[2]) end
if #KEYS == 6 then redis.call('INCR', KEYS[6]) end
{_LIST_TENANT}return id
"""
# ARGV: the tenant, the entry's input bytes (added to the fifth key, the model's queued
# bytes, in the same script as the entry), then the entry's fields. A bulk lane's stream
# comes with a sixth key, the bulk lane's counter, moved with the sequence in the same
# script: the arrival rate (the sequence less it) never sees one without the other.
# The same for many messages of one tenant's stream: one script call, one INCRBY of
# the sequence, one listing; ARGV: tenant, count, their input bytes, then each message
# as its number of field/value items followed by them. A group commit and a feeder chunk
# enqueue this way, so Redis runs its script once per stream, not once per job.
_ENQUEUE_MANY = f"""
local count = tonumber(ARGV[2])
local at = 4
for _ = 1, count do
  local width = tonumber(ARGV[at])
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, at + 1, at + width))
  at = at + width + 1
end
local seq = redis.call('INCRBY', KEYS[4], count)
if tonumber(ARGV[3]) > 0 then redis.call('INCRBY', KEYS[5], ARGV[3]) end
if #KEYS == 6 then redis.call('INCRBY', KEYS[6], count) end
{_LIST_TENANT}return count
"""
# At most this many messages in one script call: Redis runs nothing else meanwhile.
ENQUEUE_MANY_MAX = 256
# Acknowledge and delete entries, and take their input bytes off the model's count, at
# once. KEYS: the queued bytes, then each stream; ARGV: the group, the bytes, then for
# each stream the number of its ids followed by them. A script, not a MULTI: Redis at
# maxmemory refuses every command queued in a MULTI, and an acknowledgement is what
# frees its memory. A script that has written (XACK) may go on past maxmemory, so the
# DECRBY is not refused either.
_ACK = """
local at = 3
for k = 2, #KEYS do
  local n = tonumber(ARGV[at])
  redis.call('XACK', KEYS[k], ARGV[1], unpack(ARGV, at + 1, at + n))
  redis.call('XDEL', KEYS[k], unpack(ARGV, at + 1, at + n))
  at = at + n + 1
end
if tonumber(ARGV[2]) > 0 then redis.call('DECRBY', KEYS[1], ARGV[2]) end
return 1
"""
# Forget a tenant whose stream is empty (entries are deleted when acknowledged,
# so empty means nothing queued and nothing held by a worker).
_PRUNE = """
if redis.call('XLEN', KEYS[1]) == 0 then
  return redis.call('ZREM', KEYS[2], ARGV[1])
end
return 0
"""


def _enqueue_keys(prefix: str, model: str, lane: str, tenant: str) -> list[str]:
    """The enqueue scripts' keys: the stream, its lane's tenants, the wake stream, the
    sequence, the queued bytes, and for the bulk lane its counter."""
    keys = [
        stream_key(prefix, model, lane, tenant),
        tenants_key(prefix, model, lane),
        wake_key(prefix, model),
        seq_key(prefix, model),
        queued_bytes_key(prefix, model),
    ]
    return [*keys, bulk_seq_key(prefix, model)] if lane == Lane.BULK else keys


class Scripts:
    """The Lua scripts, registered once per client (redis-py caches them by SHA).

    In a pipeline a script call is queued as a bare EVALSHA and the pipeline run with
    :meth:`execute`: redis-py's own would ask Redis ``SCRIPT EXISTS`` before every
    pipeline it runs (a round trip and a command per group commit). A script Redis
    does not know (it restarted, failed over or was flushed) answers NOSCRIPT and
    did nothing; :meth:`execute` loads it and sends those calls again, in order.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.enqueue_script = client.register_script(_ENQUEUE)
        self.enqueue_many_script = client.register_script(_ENQUEUE_MANY)
        self.prune_script = client.register_script(_PRUNE)
        self.ack_script = client.register_script(_ACK)

    def execute(self, pipe: redis.client.Pipeline) -> list[Any]:
        """Run ``pipe`` (a pipeline of this client's); raise its first error, as
        ``pipe.execute()`` does, once the script calls Redis did not know are run."""
        if is_cluster(pipe):
            return list(pipe.execute())  # script calls go there as EVAL: nothing to load
        queued = [args for args, _options in pipe.command_stack]
        results = list(pipe.execute(raise_on_error=False))
        unknown = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if unknown:
            for script in (
                self.enqueue_script,
                self.enqueue_many_script,
                self.prune_script,
                self.ack_script,
            ):
                script.sha = self.client.script_load(script.script)
            for i in unknown:
                results[i] = self.client.execute_command(*queued[i])
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    @staticmethod
    def _run(
        script: Script,
        target: redis.Redis | redis.client.Pipeline,
        keys: list[str],
        args: list[str | int],
    ) -> Any:
        if is_cluster(target):
            # A Cluster pipeline refuses EVALSHA, and a node a slot has just moved to may
            # not have the script: EVAL sends it whole (Redis compiles it once per node).
            # In a pipeline the node is named, or redis-py would ask a node for the
            # script's keys first (COMMAND GETKEYS, a round trip per call); a MOVED or ASK
            # reply is still followed, the command sent again on its own.
            named = (
                {"target_nodes": target.get_node_from_key(keys[0])} if is_pipeline(target) else {}
            )
            return target.execute_command("EVAL", script.script, len(keys), *keys, *args, **named)
        if isinstance(target, redis.client.Pipeline):
            return target.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return script(keys=keys, args=args, client=target)

    def enqueue(
        self,
        target: redis.Redis | redis.client.Pipeline,
        prefix: str,
        model: str,
        message: JobMessage,
    ) -> Any:
        """Add the message to its tenant's stream in its lane (the shared one without a tenant)."""
        fields = message.encode()
        tenant = message.tenant
        if not tenant:
            # The entry before the sequence moves: a worker that sees the sequence it
            # found the shared stream drained at skips the stream (consumer.refresh).
            added = target.xadd(stream_key(prefix, model, message.lane), fields)  # type: ignore[arg-type]
            target.incr(seq_key(prefix, model))
            if message.lane == Lane.BULK:
                target.incr(bulk_seq_key(prefix, model))
            if message.input_bytes:
                target.incrby(queued_bytes_key(prefix, model), message.input_bytes)
            return added
        flat = [item for pair in fields.items() for item in pair]
        return self._run(
            self.enqueue_script,
            target,
            _enqueue_keys(prefix, model, message.lane, tenant),
            [tenant, message.input_bytes, *flat],
        )

    def enqueue_all(
        self,
        target: redis.Redis | redis.client.Pipeline,
        prefix: str,
        items: Iterable[tuple[str, JobMessage]],
    ) -> None:
        """Add every ``(model, message)``, as :meth:`enqueue` would one by one: each
        tenant's messages in one script call (up to :data:`ENQUEUE_MANY_MAX`), in order."""
        streams: dict[tuple[str, str, str | None], list[JobMessage]] = {}
        for model, message in items:
            streams.setdefault((model, message.lane, message.tenant or None), []).append(message)
        for (model, lane, tenant), messages in streams.items():
            if not tenant:
                for message in messages:  # before the sequence moves, as in enqueue
                    target.xadd(stream_key(prefix, model, lane), message.encode())  # type: ignore[arg-type]
                target.incrby(seq_key(prefix, model), len(messages))
                if lane == Lane.BULK:
                    target.incrby(bulk_seq_key(prefix, model), len(messages))
                if size := sum(message.input_bytes for message in messages):
                    target.incrby(queued_bytes_key(prefix, model), size)
                continue
            for start in range(0, len(messages), ENQUEUE_MANY_MAX):
                part = messages[start : start + ENQUEUE_MANY_MAX]
                size = sum(message.input_bytes for message in part)
                args: list[str | int] = [tenant, len(part), size]
                for message in part:
                    flat = [item for pair in message.encode().items() for item in pair]
                    args += [len(flat), *flat]
                self._run(
                    self.enqueue_many_script,
                    target,
                    _enqueue_keys(prefix, model, lane, tenant),
                    args,
                )

    def ack(
        self,
        target: redis.Redis | redis.client.Pipeline,
        prefix: str,
        model: str,
        entries: Mapping[str, Sequence[str]],
        input_bytes: int,
    ) -> Any:
        """Acknowledge and delete each stream's entry ids, and take ``input_bytes`` off the
        model's queued bytes, in one script call."""
        keys = [queued_bytes_key(prefix, model), *entries]
        args: list[str | int] = [GROUP, input_bytes]
        for ids in entries.values():
            args += [len(ids), *ids]
        return self._run(self.ack_script, target, keys, args)

    def prune(
        self,
        target: redis.Redis | redis.client.Pipeline,
        prefix: str,
        model: str,
        lane: str,
        tenant: str,
    ) -> Any:
        """Unlist ``tenant`` from the lane if its stream is empty (1 if it was unlisted)."""
        return self._run(
            self.prune_script,
            target,
            [stream_key(prefix, model, lane, tenant), tenants_key(prefix, model, lane)],
            [tenant],
        )


def events_key(prefix: str, model: str, job_id: str) -> str:
    """Stream of one job's events (its tokens as they come, its status changes, its end).

    Written by the worker that runs the job, read by any API process serving
    ``GET /v1/jobs/{id}/events``; an entry's id is the Server-Sent Event's id,
    so a client resumes after exactly the last event it saw
    (``core.streams.events``).
    """
    return f"{prefix}:{{{model}}}:events:{job_id}"


def events_wake_key(prefix: str, model: str, process: str) -> str:
    """Stream an API process reads beside its clients' events streams of a model, in the
    same blocked XREAD (the model's hash tag): an entry added wakes that read, for a
    client that has come meanwhile (``api.jobs.tails``)."""
    return f"{prefix}:{{{model}}}:events-wake:{process}"


def cancels_key(prefix: str, model: str) -> str:
    """Set of the model's running jobs a client asked to stop; the worker running
    one stops it at its next step (``DELETE /v1/jobs/{id}``)."""
    return f"{prefix}:{{{model}}}:cancels"


def dead_letter_key(prefix: str, model: str) -> str:
    return f"{prefix}:{{{model}}}:dead"


def done_channel(prefix: str) -> str:
    """Pub/sub channel on which workers announce finished job ids."""
    return f"{prefix}:done"


def workers_key(prefix: str, model: str) -> str:
    """Sorted set of the model's workers, scored by their last heartbeat (epoch seconds)."""
    return f"{prefix}:{{{model}}}:workers"


def versions_key(prefix: str, model: str) -> str:
    """Hash of each worker's versions of the model: ``"<version>|<consumer>"`` -> JSON state."""
    return f"{prefix}:{{{model}}}:versions"


def stats_key(prefix: str, model: str) -> str:
    """Hash of the model's learned numbers (batch latency), written by workers."""
    return f"{prefix}:{{{model}}}:stats"


@dataclass(frozen=True)
class JobMessage:
    """What a stream entry carries: enough to schedule, not the input itself."""

    job_id: str
    lane: str
    cost: int
    enqueued_at_ms: int
    deadline_at_ms: int | None = None
    request_id: str | None = None
    tenant: str | None = None  # the API key whose job it is
    version: int | None = None  # the model version the job asked for (None: the active one)
    trace_context: str | None = None  # the W3C traceparent of the request that made it
    input_bytes: int = 0  # its input's size as stored, counted in queued_bytes_key (0: not)

    @classmethod
    def of_job(cls, job: Any, input_bytes: int = 0) -> JobMessage:
        """The entry of a job's row (a Job, or a row with its columns under their names)."""
        return cls(
            job_id=job.id,
            lane=job.priority,
            cost=job.cost,
            enqueued_at_ms=int(job.created_at.timestamp() * 1000),
            deadline_at_ms=int(job.deadline_at.timestamp() * 1000) if job.deadline_at else None,
            request_id=job.request_id,
            tenant=job.api_key_id,
            version=job.requested_version,
            trace_context=getattr(job, "trace_context", None),
            input_bytes=input_bytes,
        )

    def encode(self) -> dict[str, str]:
        fields = {
            "v": str(PROTOCOL_VERSION),
            "job": self.job_id,
            "lane": self.lane,
            "cost": str(self.cost),
            "enq": str(self.enqueued_at_ms),
        }
        if self.deadline_at_ms is not None:
            fields["dl"] = str(self.deadline_at_ms)
        if self.request_id:
            fields["rid"] = self.request_id
        if self.tenant:
            fields["t"] = self.tenant
        if self.version is not None:
            fields["ver"] = str(self.version)
        if self.trace_context:
            fields["tp"] = self.trace_context
        if self.input_bytes:
            fields["b"] = str(self.input_bytes)
        return fields

    @classmethod
    def decode(cls, fields: Mapping[bytes | str, bytes | str]) -> JobMessage:
        try:
            f = {_text(k): _text(v) for k, v in fields.items()}
            if f["v"] != str(PROTOCOL_VERSION):
                raise ProtocolError(f"unsupported protocol version {f['v']!r}")
            lane = f["lane"]
            if lane not in LANES:
                raise ProtocolError(f"unknown lane {lane!r}")
            cost = int(f["cost"])
            if cost < 0:
                raise ProtocolError("negative cost")
            return cls(
                job_id=f["job"],
                lane=lane,
                cost=cost,
                enqueued_at_ms=int(f["enq"]),
                deadline_at_ms=int(f["dl"]) if "dl" in f else None,
                request_id=f.get("rid"),
                tenant=f.get("t"),
                version=int(f["ver"]) if "ver" in f else None,
                trace_context=f.get("tp"),
                input_bytes=max(0, int(f.get("b", 0))),
            )
        except ProtocolError:
            raise
        except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as exc:
            raise ProtocolError(f"malformed job message: {exc!r}") from exc


def is_wake(fields: Mapping[bytes | str, bytes | str] | None) -> bool:
    """Whether a stream entry is a wake-up marker rather than a job."""
    return bool(fields) and (WAKE_FIELD in fields or WAKE_FIELD.encode() in fields)  # type: ignore[operator]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
