"""Reading queue depth from the streams (for /v1/models and wait estimates)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from core.settings import LANES
from core.streams import GROUP, lane_streams, stats_key, workers_key

DEPTH_SCAN_LIMIT = 10_000
HEARTBEAT_TTL_S = 10.0  # a worker that has not beaten for this long is not live


@dataclass(frozen=True)
class LaneState:
    pending: int  # read by a worker, not acknowledged yet
    lag: int  # read by no worker yet

    @property
    def depth(self) -> int:
        return self.pending + self.lag


def lane_states(client: redis.Redis, prefix: str, model: str) -> dict[str, LaneState]:
    """Per lane, from the consumer group: entries held by workers and entries not yet read."""
    keys = lane_streams(prefix, model)
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    exists = pipe.execute()
    pipe = client.pipeline(transaction=False)
    for key, present in zip(keys, exists, strict=True):
        if present:
            pipe.xinfo_groups(key)
    infos = iter(pipe.execute())
    states: dict[str, LaneState] = {}
    for lane, key, present in zip(LANES, keys, exists, strict=True):
        if not present:
            states[lane] = LaneState(0, 0)
            continue
        group = _group(next(infos))
        if group is None:
            states[lane] = LaneState(0, int(client.xlen(key)))
            continue
        lag = group.get("lag")
        if lag is None:  # Redis < 7 reports no lag: count what follows the last delivered id
            last_id = str(group.get("last-delivered-id") or "0-0")
            tail: Any = client.xrange(key, min=f"({last_id}", count=DEPTH_SCAN_LIMIT)
            lag = len(tail)
        states[lane] = LaneState(int(group.get("pending") or 0), int(lag))
    return states


def lane_depths(client: redis.Redis, prefix: str, model: str) -> dict[str, int]:
    """Entries per lane not yet acknowledged: delivered-but-pending plus undelivered."""
    return {lane: state.depth for lane, state in lane_states(client, prefix, model).items()}


def live_workers(client: redis.Redis, prefix: str, model: str, now: float | None = None) -> int:
    now = time.time() if now is None else now
    return int(client.zcount(workers_key(prefix, model), now - HEARTBEAT_TTL_S, "+inf"))


def model_stats(client: redis.Redis, prefix: str, model: str) -> dict[str, float]:
    raw: Any = client.hgetall(stats_key(prefix, model))
    out: dict[str, float] = {}
    for name, value in raw.items():
        try:
            out[_text(name)] = float(_text(value))
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
