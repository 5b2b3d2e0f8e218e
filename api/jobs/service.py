"""What the job routes do, callable without HTTP."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.jobs.schemas import AttemptResource, DeliveryResource, JobResource, WebhookSecret
from api.models.service import is_generation
from api.owned import is_uuid, owned
from core.db.keys import new_webhook_secret, rotate_webhook_secret
from core.db.resources import job_resource
from core.db.schema import (
    TERMINAL_STATUSES,
    ApiKey,
    Job,
    WebhookAttempt,
    WebhookDelivery,
    utcnow,
)
from core.db.terminal import after_terminal
from core.db.webhooks import TERMINAL_EVENT_TYPES, add_job_deliveries
from core.models.catalog import ModelSpec
from core.ops.metrics import JOBS_FINISHED
from core.ops.urlguard import Resolver, UrlPolicy, UrlRefused, check_url
from core.streams.protocol import cancels_key, done_channel
from core.streams.target import REDIS_ERRORS

if TYPE_CHECKING:
    from api.state import AppState


# Hands new webhook deliveries to Celery (see core.db.webhooks.DeliveryKicker).
Kick = Callable[[Sequence[str]], None]

log = logging.getLogger(__name__)


def callback_checker(policy: UrlPolicy, resolve: Resolver) -> Callable[[str], None]:
    """Refuses, with 422, a callback URL that Ferry would never call."""

    def check(url: str) -> None:
        try:
            check_url(url, policy, resolve)
        except UrlRefused as exc:
            if exc.permanent:
                raise ApiError(422, "invalid_request", f"callback_url: {exc.reason}") from None
            # DNS trouble now is not a verdict: each attempt checks again.
            log.info("callback host did not resolve; accepted", extra={"reason": exc.reason})

    return check


def get_job(session: Session, key: ApiKey, job_id: str) -> Job:
    return owned(session, Job, key, job_id, "job")


# A stop asked for a job no worker holds (it ended meanwhile) is forgotten after this.
CANCEL_TTL_S = 600


@dataclass(frozen=True)
class Cancel:
    """What DELETE did: ``job`` cancelled at once (it was queued), or, ``requested``, the
    worker running it asked to stop it (a running generation:
    ``core.streams.protocol.cancels_key``)."""

    job: Job
    requested: bool = False


def stop_generation(
    client: redis.Redis, prefix: str, catalog: dict[str, ModelSpec]
) -> Callable[[Job], bool]:
    """Asks the worker running a generation job to stop it (False: not a generation)."""

    def stop(job: Job) -> bool:
        if not is_generation(catalog, job.model):
            return False
        key = cancels_key(prefix, job.model)
        with client.pipeline(transaction=False) as pipe:
            pipe.sadd(key, job.id)
            pipe.expire(key, CANCEL_TTL_S)
            pipe.execute()
        return True

    return stop


def cancel_job(
    session: Session,
    key: ApiKey,
    job_id: str,
    kick: Kick | None = None,
    stop_running: Callable[[Job], bool] | None = None,
) -> Cancel:
    """Cancel a queued job now; a running one only if ``stop_running`` asks its worker to."""
    job = get_job(session, key, job_id)
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == "queued")
        .values(status="cancelled", finished_at=now, error="cancelled by the client")
    )
    deliveries = after_terminal(session, [job.id], now) if result.rowcount else []  # type: ignore[attr-defined]
    session.commit()
    session.refresh(job)
    if not result.rowcount:  # type: ignore[attr-defined]
        if job.status == "running" and stop_running is not None and stop_running(job):
            return Cancel(job, requested=True)
        raise ApiError(
            409,
            "conflict",
            f"job {job.id} is {job.status}; only a queued job (or a running generation) "
            "can be cancelled",
        )
    if deliveries and kick is not None:
        kick(deliveries)
    return Cancel(job)


def cancel_and_announce(state: AppState, key: ApiKey, job_id: str) -> tuple[JobResource, bool]:
    """DELETE /v1/jobs/{id} on the app's parts (a thread's work): the job as it is after,
    and whether its worker was asked to stop it (it is still running then)."""
    settings = state.settings
    stop = stop_generation(state.redis, settings.key_prefix, state.catalog)
    with state.sessions() as session:
        done = cancel_job(session, key, job_id, state.kick, stop)
        if not done.requested:
            JOBS_FINISHED.labels(done.job.model, done.job.priority, "cancelled").inc()
            # Long-polls of the job, in every API process, wake as for a worker's result.
            with contextlib.suppress(*REDIS_ERRORS):
                state.redis.publish(done_channel(settings.key_prefix), done.job.id)
        return render_job(session, done.job), done.requested


def deliveries_of(session: Session, jobs: Sequence[Job]) -> dict[str, WebhookDelivery]:
    """The terminal webhook delivery of each of these jobs that has one, in one query."""
    ids = [job.id for job in jobs if job.callback_url and job.status in TERMINAL_STATUSES]
    if not ids:
        return {}
    rows = session.scalars(
        select(WebhookDelivery).where(
            WebhookDelivery.job_id.in_(ids), WebhookDelivery.event_type.in_(TERMINAL_EVENT_TYPES)
        )
    )
    return {row.job_id: row for row in rows if row.job_id is not None}


def job_deliveries(session: Session, key: ApiKey, job_id: str) -> list[DeliveryResource]:
    job = get_job(session, key, job_id)
    deliveries = session.scalars(
        select(WebhookDelivery)
        .where(WebhookDelivery.job_id == job.id, WebhookDelivery.api_key_id == key.id)
        .order_by(WebhookDelivery.created_at)
    ).all()
    attempts: dict[str, list[WebhookAttempt]] = {d.id: [] for d in deliveries}
    if deliveries:
        for attempt in session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(list(attempts)))
            .order_by(WebhookAttempt.number)
        ):
            attempts[attempt.delivery_id].append(attempt)
    return [to_delivery_resource(d, attempts[d.id]) for d in deliveries]


def redeliver(session: Session, key: ApiKey, job_id: str, kick: Kick | None = None) -> str:
    """Send the job's terminal webhook again, from the start of the schedule, with the same
    webhook-id (its started and progress ones are in its deliveries, not sent again)."""
    job = get_job(session, key, job_id)
    if not job.callback_url:
        raise ApiError(409, "conflict", f"job {job.id} has no callback_url")
    if job.status not in TERMINAL_STATUSES:
        raise ApiError(
            409, "conflict", f"job {job.id} is {job.status}; its webhook is sent when it ends"
        )
    now = utcnow()
    delivery = session.scalars(
        select(WebhookDelivery)
        .where(
            WebhookDelivery.job_id == job.id, WebhookDelivery.event_type.in_(TERMINAL_EVENT_TYPES)
        )
        .with_for_update()
    ).one_or_none()
    if delivery is None:  # purged, or the job ended before webhooks existed
        (delivery_id,) = add_job_deliveries(session, [job.id], now)
    elif delivery.status == "delivering":
        raise ApiError(409, "conflict", f"an attempt of delivery {delivery.id} is in flight")
    else:
        delivery_id = delivery.id
        delivery.status = "pending"
        delivery.step = 0
        delivery.next_attempt_at = now
        delivery.queued_until = None
        delivery.finished_at = None
    session.commit()
    if kick is not None:
        kick([delivery_id])
    return delivery_id


def webhook_secret(session: Session, key: ApiKey, rotate: bool, grace_s: float) -> WebhookSecret:
    if rotate:
        row = rotate_webhook_secret(session, key, grace_s)
    else:
        found = session.get(ApiKey, key.id)
        assert found is not None
        row = found
        if row.webhook_secret is None:
            row.webhook_secret = new_webhook_secret()
            session.commit()
    assert row.webhook_secret is not None
    until = row.previous_webhook_secret_until
    return WebhookSecret(
        secret=row.webhook_secret,
        previous_secret_valid_until=until if until is not None and until > utcnow() else None,
    )


def list_jobs(
    session: Session,
    key: ApiKey,
    status: str | None,
    model: str | None,
    limit: int,
    cursor: str | None,
    backfill_id: str | None = None,
) -> tuple[list[Job], str | None]:
    """Newest first, paginated by an opaque (created_at, id) cursor.

    A backfill's items are listed only when its id is given: a dataset of a
    million lines must not bury the jobs submitted one by one.
    """
    if model is not None and "\x00" in model:
        raise ApiError(422, "invalid_request", "model: must not contain NUL characters")
    if backfill_id is not None and not is_uuid(backfill_id):
        raise ApiError(422, "invalid_request", "backfill_id: not a backfill id (a UUID)")
    query = select(Job).where(Job.api_key_id == key.id, Job.backfill_id == backfill_id)
    if status:
        query = query.where(Job.status == status)
    if model:
        query = query.where(Job.model == model)
    if cursor:
        created_at, last_id = _decode_cursor(cursor)
        query = query.where(
            or_(Job.created_at < created_at, and_(Job.created_at == created_at, Job.id < last_id))
        )
    rows = list(
        session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1))
    )
    next_cursor = _encode_cursor(rows[limit - 1]) if len(rows) > limit else None
    return rows[:limit], next_cursor


def _encode_cursor(job: Job) -> str:
    raw = f"{job.created_at.isoformat()}|{job.id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, job_id = raw.split("|", 1)
        created_at = dt.datetime.fromisoformat(created)
        if created_at.tzinfo is None or not is_uuid(job_id):
            raise ValueError("not a cursor")
        return created_at.astimezone(dt.UTC), job_id
    except (ValueError, OverflowError) as exc:
        raise ApiError(422, "invalid_request", "cursor: not a cursor this API returned") from exc


def to_resource(
    job: Job, estimated_wait_ms: float | None = None, delivery: WebhookDelivery | None = None
) -> JobResource:
    resource = JobResource.model_validate(job_resource(job, delivery))
    resource.estimated_wait_ms = estimated_wait_ms
    return resource


def render_job(session: Session, job: Job) -> JobResource:
    """The resource with its webhook delivery's state."""
    return to_resource(job, None, deliveries_of(session, [job]).get(job.id))


def to_delivery_resource(
    delivery: WebhookDelivery, attempts: Sequence[WebhookAttempt]
) -> DeliveryResource:
    return DeliveryResource(
        id=delivery.id,
        type=delivery.event_type,
        url=delivery.url,
        status=delivery.status,
        attempts=delivery.attempts,
        next_attempt_at=delivery.next_attempt_at
        if delivery.status in ("pending", "retrying")
        else None,
        last_status_code=delivery.last_status_code,
        last_error=delivery.last_error,
        created_at=delivery.created_at,
        finished_at=delivery.finished_at,
        attempt_log=[AttemptResource.model_validate(a, from_attributes=True) for a in attempts],
    )
