"""Request and response bodies of /v1/jobs and a job's webhooks."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from core.models.catalog import text_problem
from scheduler.vocabulary import Lane

# The longest idempotency key (the column's width).
MAX_IDEMPOTENCY_KEY = 255

JobStatus = Literal["waiting", "queued", "running", "succeeded", "failed", "expired", "cancelled"]

MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        min_length=1,
        max_length=64,
        description="A model of GET /v1/models; 'name@N' asks for its version N.",
    )
    version: int | None = Field(
        default=None,
        ge=1,
        description="The model's version to run (default: its active version).",
    )
    input: Any = Field(description="The model's input; see GET /v1/models for its schema.")
    priority: Lane = Lane.NORMAL
    deadline_ms: int | None = Field(
        default=None,
        gt=0,
        le=MAX_DEADLINE_MS,
        description="Relative to receipt: when the job must have ended (a generation job: "
        "queue, prefill and every token).",
    )
    on_deadline: Literal["refuse", "truncate"] = Field(
        default="refuse",
        description="A generation job whose deadline_ms its max_tokens cannot meet: refuse it "
        "(429 deadline_unattainable), or accept it with the largest max_tokens that can "
        "(said in the 202's max_tokens).",
    )
    callback_url: str | None = Field(default=None, max_length=2048)
    callback_events: list[Literal["started", "progress", "terminal"]] | None = Field(
        default=None,
        min_length=1,
        max_length=3,
        description="The webhooks to send to callback_url (default: terminal only): started "
        "(a worker began it, at each attempt) and progress (its tokens so far, at most every "
        "FERRY_PROGRESS_EVERY_S) for a generation job, terminal (its outcome) for any.",
    )
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=MAX_IDEMPOTENCY_KEY)
    metadata: dict[str, Any] | None = None

    @field_validator("model", "idempotency_key", "callback_url")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        problem = text_problem(value)
        if problem:
            raise ValueError(f"must not contain {problem}")
        return value

    @field_validator("input", "metadata")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        try:
            json.dumps(value, allow_nan=False)
        except ValueError as exc:
            raise ValueError("must not contain NaN or Infinity") from exc
        problem = text_problem(value)
        if problem:
            raise ValueError(f"must not contain {problem}")
        return value

    @field_validator("callback_events")
    @classmethod
    def _events(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is None:
            return None
        if len(set(value)) != len(value):
            raise ValueError("must not name an event twice")
        if info.data.get("callback_url") is None:
            raise ValueError("needs a callback_url to send them to")
        return value

    @field_validator("callback_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an absolute http(s) URL")
        return value


class BatchInfo(BaseModel):
    id: str
    size: int | None


class Timings(BaseModel):
    queue_ms: float | None
    inference_ms: float | None
    total_ms: float | None


DeliveryStatus = Literal["pending", "delivering", "retrying", "delivered", "failed"]


class CallbackInfo(BaseModel):
    url: str
    status: DeliveryStatus = Field(
        description="pending until the job ends and while the first attempt is due; then "
        "delivering, retrying (an attempt failed, another is scheduled), delivered or failed."
    )
    attempts: int
    last_status_code: int | None
    last_error: str | None = None
    next_attempt_at: dt.datetime | None = Field(
        default=None, description="When the next attempt is due (pending or retrying)."
    )


class AttemptResource(BaseModel):
    number: int
    started_at: dt.datetime
    duration_ms: float | None = Field(description="null: abandoned (the sender stopped).")
    status_code: int | None
    error: str | None


class DeliveryResource(BaseModel):
    id: str = Field(description="The webhook-id header: the same on every attempt.")
    type: str = Field(description="The event, e.g. job.succeeded.")
    url: str
    status: DeliveryStatus
    attempts: int
    next_attempt_at: dt.datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: dt.datetime
    finished_at: dt.datetime | None
    attempt_log: list[AttemptResource] = Field(description="Every attempt, oldest first.")


class DeliveryList(BaseModel):
    data: list[DeliveryResource]


class WebhookSecret(BaseModel):
    secret: str = Field(description="Signs every webhook (Standard Webhooks, whsec_...).")
    previous_secret_valid_until: dt.datetime | None = Field(
        description="After a rotation the previous secret also signs until then."
    )


class Progress(BaseModel):
    """How far a running generation has come."""

    tokens: int = Field(
        description="Tokens generated so far (those in its events stream, across takeovers)."
    )
    max_tokens: int = Field(description="The most it will generate.")
    eta_ms: float | None = Field(
        description="Predicted milliseconds until it ends were it to run to its max_tokens "
        "(it may end sooner, at a stop); from the decode step time its workers learned, null "
        "before they have published one or for a model run through generate()."
    )


class JobResource(BaseModel):
    id: str
    model: str
    model_version: int | None = Field(
        description="The version of the model that ran the job (null until it starts)."
    )
    requested_version: int | None = Field(
        description="The version the job asked for (null: the model's active version)."
    )
    status: JobStatus
    priority: Lane
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    deadline_at: dt.datetime | None
    output: Any | None
    error: str | None
    attempts: int
    batch: BatchInfo | None
    timings: Timings
    callback: CallbackInfo | None
    metadata: dict[str, Any] | None
    estimated_wait_ms: float | None = Field(
        default=None,
        description="Only on the 202 that accepted the job: predicted milliseconds until it "
        "finishes (a generation job: until its first token), from the queue ahead and what "
        "the workers learned (null until a worker has published its estimates).",
    )
    max_tokens: int | None = Field(
        default=None,
        description="Only on the 202 of a generation job accepted with on_deadline truncate "
        "whose max_tokens its deadline could not meet: the max_tokens it runs with.",
    )
    progress: Progress | None = Field(
        default=None,
        description="Only on GET /v1/jobs/{id} of a running generation job: the tokens it "
        "has generated so far and the predicted time until it ends.",
    )


class JobList(BaseModel):
    data: list[JobResource]
    next_cursor: str | None


def metadata_problem(value: dict[str, Any] | None, max_bytes: int) -> str | None:
    """Why this metadata is refused under the limit (None: it is not)."""
    if value is not None and len(_compact_json(value)) > max_bytes:
        return f"must be at most {max_bytes} bytes of JSON"
    return None


def _compact_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class CancelRequested(JobResource):
    """A running generation asked to stop: still ``running`` here; its worker ends it
    ``cancelled`` at its next step, with the tokens it made so far."""

    cancel_requested: bool = Field(
        True, description="The worker running the job was asked to stop it."
    )
