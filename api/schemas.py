"""The error body every route answers with, and its entries in the OpenAPI document.

Each resource's own request and response bodies are in its package's ``schemas``
(api/jobs, api/backfills, api/models, api/openai).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    type: str = Field(description="Machine-readable kind, e.g. invalid_request, not_found.")
    message: str = Field(description="What went wrong; names the field for invalid input.")
    estimated_wait_ms: float | None = Field(
        default=None, description="On deadline_unattainable: when the job would have finished."
    )


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer."""
    meaning = {
        400: "Malformed JSON.",
        401: "Missing, malformed or revoked API key.",
        403: "The key lacks the admin scope this endpoint needs.",
        404: "No such job for this key.",
        409: "The job is in the wrong state, or the idempotency key was used differently, "
        "or a delivery attempt is in flight.",
        413: "Request body too large.",
        415: "The body is not sent as application/json.",
        422: "Invalid input; the message names the field.",
        429: "rate_limited: the key is over its request rate (see Retry-After); "
        "quota_exceeded: too much of the key's work is outstanding; or "
        "deadline_unattainable: the queue ahead makes the deadline impossible "
        "(the error carries estimated_wait_ms).",
        503: "Redis or the database is unavailable; see Retry-After.",
    }
    return {s: {"model": ErrorBody, "description": meaning[s]} for s in statuses}
