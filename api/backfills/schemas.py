"""Request and response bodies of /v1/backfills."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, Field

BackfillStatus = Literal[
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "cancelling",
    "cancelled",
    "expiring",
    "expired",
]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int
    expired: int
    cancelled: int


class BackfillResource(BaseModel):
    id: str
    model: str
    status: BackfillStatus
    callback_url: str | None
    request_counts: RequestCounts
    input_bytes: int
    error: str | None
    created_at: dt.datetime
    in_progress_at: dt.datetime | None
    finalizing_at: dt.datetime | None
    finished_at: dt.datetime | None
    cancelling_at: dt.datetime | None
    expires_at: dt.datetime | None = Field(
        None, description="Lines not run by then are expired (an OpenAI batch's window)."
    )
    eta_s: float | None = Field(
        description="Seconds left at the rate seen so far (before any result: from the "
        "model's learned throughput)."
    )


class BackfillList(BaseModel):
    data: list[BackfillResource]
