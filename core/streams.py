"""Redis key names and the stream message protocol, in one place.

Every key of one model carries the ``{model}`` hash tag so that all of a model's
streams land in one Redis Cluster slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from core.settings import LANES

PROTOCOL_VERSION = 1
GROUP = "workers"


class ProtocolError(ValueError):
    """A stream entry that is not a valid Ferry message."""


def stream_key(prefix: str, model: str, lane: str) -> str:
    return f"{prefix}:{{{model}}}:{lane}"


def lane_streams(prefix: str, model: str) -> list[str]:
    """The model's streams, most urgent lane first."""
    return [stream_key(prefix, model, lane) for lane in LANES]


def dead_letter_key(prefix: str, model: str) -> str:
    return f"{prefix}:{{{model}}}:dead"


def done_channel(prefix: str) -> str:
    """Pub/sub channel on which workers announce finished job ids."""
    return f"{prefix}:done"


def workers_key(prefix: str, model: str) -> str:
    """Sorted set of the model's workers, scored by their last heartbeat (epoch seconds)."""
    return f"{prefix}:{{{model}}}:workers"


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
            )
        except ProtocolError:
            raise
        except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as exc:
            raise ProtocolError(f"malformed job message: {exc!r}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
