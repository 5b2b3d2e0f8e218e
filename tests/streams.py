"""Reading a model's streams in tests: every tenant's stream of a lane, without wake-ups,
and the jobs a worker holds."""

from __future__ import annotations

from typing import Any

import redis

from core.streams.protocol import GROUP, JobMessage, is_wake, stream_key
from core.streams.queues import lane_tenants, model_streams
from scheduler.vocabulary import LANES


def lane_stream_names(client: redis.Redis, prefix: str, model: str, lane: str) -> list[str]:
    """The lane's shared stream and each listed tenant's."""
    tenants = lane_tenants(client, prefix, model)[lane]
    return [stream_key(prefix, model, lane), *(stream_key(prefix, model, lane, t) for t in tenants)]


def held_jobs(client: redis.Redis, prefix: str, model: str, consumer: str) -> list[str]:
    """The jobs of the model's entries ``consumer`` read and has not acknowledged."""
    held: list[str] = []
    for stream in model_streams(client, prefix, model):
        try:
            pending: Any = client.xpending_range(
                stream, GROUP, min="-", max="+", count=1000, consumername=consumer
            )
        except redis.ResponseError:
            continue  # a tenant's stream emptied and removed since it was listed
        pipe = client.pipeline(transaction=False)
        for entry in pending:
            pipe.xrange(stream, min=entry["message_id"], max=entry["message_id"])
        for found in pipe.execute():
            held += [str(fields["job"]) for _id, fields in found]
    return held


def lane_messages(client: redis.Redis, prefix: str, model: str, lane: str) -> list[JobMessage]:
    """The job messages in the lane's streams (wake-up markers left out)."""
    messages = []
    for stream in lane_stream_names(client, prefix, model, lane):
        entries: Any = client.xrange(stream)
        messages += [JobMessage.decode(f) for _id, f in entries if not is_wake(f)]
    return messages


def model_messages(client: redis.Redis, prefix: str, model: str) -> list[JobMessage]:
    return [m for lane in LANES for m in lane_messages(client, prefix, model, lane)]


def lane_pending(client: redis.Redis, prefix: str, model: str, lane: str) -> int:
    """Entries of the lane delivered to a worker and not acknowledged."""
    total = 0
    for stream in lane_stream_names(client, prefix, model, lane):
        if client.exists(stream):
            info: Any = client.xpending(stream, GROUP)
            total += int(info["pending"])
    return total


def forget_model(client: redis.Redis, prefix: str, model: str) -> None:
    """Delete every key of the model's, as a Redis that lost its data would."""
    keys = list(client.scan_iter(match=f"{prefix}:{{{model}}}:*", count=1000))
    if keys:
        client.delete(*keys)
