"""The API's resources as typed objects (fields the client does not know are kept, not refused)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, ConfigDict

TERMINAL = frozenset({"succeeded", "failed", "expired", "cancelled"})


class Resource(BaseModel):
    # A newer server may add fields: they are kept (model_extra), never an error.
    model_config = ConfigDict(extra="allow")


class Job(Resource):
    id: str
    model: str
    status: str  # waiting | queued | running | succeeded | failed | expired | cancelled
    priority: str
    created_at: dt.datetime
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    deadline_at: dt.datetime | None = None
    model_version: int | None = None
    requested_version: int | None = None
    output: Any | None = None
    error: str | None = None
    attempts: int = 0
    batch: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    callback: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    estimated_wait_ms: float | None = None
    # A running generation: {"tokens": so far, "max_tokens": ..., "eta_ms": ... | None}.
    progress: dict[str, Any] | None = None
    max_tokens: int | None = None  # the 202 of a generation job its deadline truncated

    @property
    def done(self) -> bool:
        """The job has ended (succeeded, failed, expired or cancelled)."""
        return self.status in TERMINAL


class RequestCounts(Resource):
    total: int
    completed: int
    failed: int
    expired: int
    cancelled: int


class Backfill(Resource):
    id: str
    model: str
    status: str
    request_counts: RequestCounts
    input_bytes: int = 0
    error: str | None = None
    callback_url: str | None = None
    created_at: dt.datetime
    finished_at: dt.datetime | None = None
    eta_s: float | None = None

    @property
    def done(self) -> bool:
        return self.status in ("completed", "failed", "cancelled", "expired")


class Model(Resource):
    name: str
    backend: str
    version: int  # the active version
    description: str = ""
    workers: int = 0
    max_batch_size: int = 0
    queue_depth: dict[str, int] = {}
