"""Reading queue depth from the streams (for /v1/models and wait estimates)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from core.streams.protocol import (
    GROUP,
    bulk_seq_key,
    queued_bytes_key,
    seq_key,
    stats_key,
    stream_key,
    tenants_key,
    workers_key,
)
from scheduler.vocabulary import LANES, Lane

DEPTH_SCAN_LIMIT = 10_000
HEARTBEAT_TTL_S = 10.0  # a worker that has not beaten for this long is not live


@dataclass(frozen=True)
class LaneState:
    pending: int  # read by a worker, not acknowledged yet
    lag: int  # read by no worker yet

    @property
    def depth(self) -> int:
        return self.pending + self.lag


def lane_tenants(client: redis.Redis, prefix: str, model: str) -> dict[str, list[str]]:
    """Per lane, the tenants with a stream that may hold entries, least recently added to first."""
    pipe = client.pipeline(transaction=False)
    for lane in LANES:
        pipe.zrange(tenants_key(prefix, model, lane), 0, -1)
    return {lane: [_text(t) for t in got] for lane, got in zip(LANES, pipe.execute(), strict=True)}


def model_streams(client: redis.Redis, prefix: str, model: str) -> list[str]:
    """Every stream of the model's lanes: each lane's shared stream, then its tenants'."""
    return [
        stream_key(prefix, model, lane, tenant)
        for lane, tenants in lane_tenants(client, prefix, model).items()
        for tenant in [None, *tenants]
    ]


def tenant_depths(client: redis.Redis, prefix: str, model: str) -> dict[str, dict[str, int]]:
    """Per lane, the entries not yet acknowledged in each tenant's stream ('' is the shared one).

    Acknowledged entries are deleted at once, so a stream's length is its depth.
    """
    streams = [
        (lane, tenant)
        for lane, tenants in lane_tenants(client, prefix, model).items()
        for tenant in ["", *tenants]
    ]
    pipe = client.pipeline(transaction=False)
    for lane, tenant in streams:
        pipe.xlen(stream_key(prefix, model, lane, tenant or None))
    depths: dict[str, dict[str, int]] = {lane: {} for lane in LANES}
    for (lane, tenant), length in zip(streams, pipe.execute(), strict=True):
        depths[lane][tenant] = int(length)
    return depths


def lane_states(
    client: redis.Redis,
    prefix: str,
    model: str,
    depths: dict[str, dict[str, int]] | None = None,
) -> dict[str, LaneState]:
    """Per lane, from the consumer groups: entries held by workers and entries not yet read
    (``depths``: :func:`tenant_depths` if the caller has read them already)."""
    keys = [
        (lane, stream_key(prefix, model, lane, tenant or None))
        for lane, by_tenant in (depths or tenant_depths(client, prefix, model)).items()
        for tenant, depth in by_tenant.items()
        if depth
    ]
    pipe = client.pipeline(transaction=False)
    for _lane, key in keys:
        pipe.xinfo_groups(key)
    states: dict[str, LaneState] = {lane: LaneState(0, 0) for lane in LANES}
    for (lane, key), groups in zip(keys, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(groups, redis.ResponseError):
            continue  # emptied and deleted meanwhile
        was = states[lane]
        here = _stream_state(client, key, _group(groups))
        states[lane] = LaneState(was.pending + here.pending, was.lag + here.lag)
    return states


def _stream_state(client: redis.Redis, key: str, group: dict[str, Any] | None) -> LaneState:
    if group is None:
        return LaneState(0, int(client.xlen(key)))
    lag = group.get("lag")
    if lag is None:  # Redis < 7 reports no lag: count what follows the last delivered id
        last_id = str(group.get("last-delivered-id") or "0-0")
        tail: Any = client.xrange(key, min=f"({last_id}", count=DEPTH_SCAN_LIMIT)
        lag = len(tail)
    return LaneState(int(group.get("pending") or 0), int(lag))


def lane_depths(client: redis.Redis, prefix: str, model: str) -> dict[str, int]:
    """Entries per lane not yet acknowledged: delivered-but-pending plus undelivered."""
    return {
        lane: sum(by_tenant.values())
        for lane, by_tenant in tenant_depths(client, prefix, model).items()
    }


def arrivals(client: redis.Redis, prefix: str, model: str) -> int:
    """Jobs enqueued in the model's live lanes (not bulk) since its counters began: every
    enqueue less the bulk lane's (both kept beside the streams, lost and begun again
    with them)."""
    enqueued, bulk = client.mget(seq_key(prefix, model), bulk_seq_key(prefix, model))
    return int(enqueued or 0) - int(bulk or 0)


def nearest_deadline_ms(
    client: redis.Redis,
    prefix: str,
    model: str,
    depths: dict[str, dict[str, int]] | None = None,
) -> int | None:
    """The nearest deadline among the first entries of the model's streams (epoch ms).

    A stream is read in order, so its first entry is the one waiting longest;
    jobs of one lane are given similar deadlines, so the first entries hold
    the nearest ones without reading whole streams.
    """
    keys = [
        stream_key(prefix, model, lane, tenant or None)
        for lane, by_tenant in (depths or tenant_depths(client, prefix, model)).items()
        for tenant, depth in by_tenant.items()
        if depth and lane != Lane.BULK  # a backfill's lines have no deadline
    ]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.xrange(key, count=1)
    nearest = None
    for entries in pipe.execute(raise_on_error=False):
        if isinstance(entries, redis.ResponseError) or not entries:
            continue
        _entry_id, fields = entries[0]
        deadline = fields.get(b"dl", fields.get("dl"))
        if deadline is not None:
            at = int(_text(deadline))
            nearest = at if nearest is None else min(nearest, at)
    return nearest


def queued_bytes(client: redis.Redis, prefix: str, model: str) -> int:
    """The input bytes of the model's stream entries, as the enqueue scripts and the workers'
    acknowledgements count them (never below 0)."""
    return max(0, int(client.get(queued_bytes_key(prefix, model)) or 0))


def live_workers(client: redis.Redis, prefix: str, model: str, now: float | None = None) -> int:
    now = time.time() if now is None else now
    return int(client.zcount(workers_key(prefix, model), now - HEARTBEAT_TTL_S, "+inf"))


def model_stats(client: redis.Redis, prefix: str, model: str) -> dict[str, float]:
    """The numbers of the model's stats hash (:func:`numeric_stats` of :func:`stats_text`)."""
    return numeric_stats(stats_text(client, prefix, model))


def stats_text(client: redis.Redis, prefix: str, model: str) -> dict[str, str]:
    """The model's stats hash as its workers wrote it (a generation's holds words too)."""
    raw: Any = client.hgetall(stats_key(prefix, model))
    return {_text(name): _text(value) for name, value in raw.items()}


def numeric_stats(raw: dict[str, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in raw.items():
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def _group(groups: list[dict[Any, Any]]) -> dict[str, Any] | None:
    for group in groups:
        normalized = {_text(k): v for k, v in group.items()}
        if _text(normalized.get("name", "")) == GROUP:
            return {k: _text(v) if isinstance(v, bytes) else v for k, v in normalized.items()}
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
