"""The job resource as JSON: what ``GET /v1/jobs/{id}`` returns and a webhook carries.

It lives here, not in the API, because the worker and the Celery worker build
webhook payloads from the same rows; the API validates it against its
``JobResource`` schema.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from core.db.schema import Job, WebhookDelivery


def iso(moment: dt.datetime | None) -> str | None:
    """UTC, ``Z``-suffixed, as the API's JSON writes datetimes."""
    if moment is None:
        return None
    return moment.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def callback_of(job: Job, delivery: WebhookDelivery | None) -> dict[str, Any] | None:
    if not job.callback_url:
        return None
    if delivery is None:
        return {
            "url": job.callback_url,
            "status": "pending",
            "attempts": 0,
            "last_status_code": None,
            "last_error": None,
            "next_attempt_at": None,
        }
    return {
        "url": delivery.url,
        "status": delivery.status,
        "attempts": delivery.attempts,
        "last_status_code": delivery.last_status_code,
        "last_error": delivery.last_error,
        "next_attempt_at": iso(delivery.next_attempt_at)
        if delivery.status in ("pending", "retrying")
        else None,
    }


def job_resource(job: Job, delivery: WebhookDelivery | None = None) -> dict[str, Any]:
    def ms(start: dt.datetime | None, end: dt.datetime | None) -> float | None:
        if start is None or end is None:
            return None
        return round((end - start).total_seconds() * 1000.0, 3)

    return {
        "id": job.id,
        "model": job.model,
        "model_version": job.model_version,
        "requested_version": job.requested_version,
        "status": job.status,
        "priority": job.priority,
        "created_at": iso(job.created_at),
        "started_at": iso(job.started_at),
        "finished_at": iso(job.finished_at),
        "deadline_at": iso(job.deadline_at),
        "output": job.output,
        "error": job.error,
        "attempts": job.attempts,
        "batch": {"id": job.batch_id, "size": job.batch_size} if job.batch_id else None,
        "timings": {
            "queue_ms": ms(job.created_at, job.started_at),
            "inference_ms": round(job.inference_ms, 3) if job.inference_ms is not None else None,
            "total_ms": ms(job.created_at, job.finished_at),
        },
        "callback": callback_of(job, delivery),
        "metadata": job.metadata_,
    }
