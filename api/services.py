"""What the job routes do, callable without HTTP."""

from __future__ import annotations

import base64
import datetime as dt
import logging
import re
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis
from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.schemas import (
    AttemptResource,
    DeliveryResource,
    JobCreate,
    JobResource,
    WebhookSecret,
    metadata_problem,
)
from backends.catalog import LiveVersions
from core.catalog import MAX_JSON_DEPTH, InputError, ModelSpec, nesting_problem
from core.db import (
    TERMINAL_STATUSES,
    ApiKey,
    Backfill,
    Job,
    WebhookAttempt,
    WebhookDelivery,
    utcnow,
)
from core.estimates import ModelEstimate, estimate_wait_s, jobs_ahead
from core.keys import new_webhook_secret, rotate_webhook_secret
from core.queues import live_workers, model_stats, tenant_depths
from core.resources import job_resource
from core.streams import JobMessage, Scripts
from core.terminal import after_terminal
from core.urlguard import Resolver, UrlPolicy, UrlRefused, check_url
from core.webhooks import add_job_deliveries

Owned = TypeVar("Owned", Job, Backfill)

# Hands new webhook deliveries to Celery (see core.webhooks.DeliveryKicker).
Kick = Callable[[Sequence[str]], None]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    job: Job
    replayed: bool
    estimated_wait_ms: float | None


QUOTA_RETRY_AFTER_S = 5


def check_job_quota(session: Session, key: ApiKey, limit: int | None) -> None:
    """A 429 while the key has ``limit`` jobs queued or running (counting stops there).

    Two submissions racing past the last free slot may both be accepted: the
    quota keeps a tenant from flooding the queue, it is not an exact count.
    """
    if limit is None:
        return
    outstanding = session.scalar(
        select(func.count()).select_from(
            select(Job.id)
            .where(Job.api_key_id == key.id, Job.status.in_(("queued", "running")))
            .where(Job.backfill_id.is_(None))
            .limit(limit)
            .subquery()
        )
    )
    if (outstanding or 0) >= limit:
        raise ApiError(
            429,
            "quota_exceeded",
            f"jobs outstanding: this key has {limit} jobs queued or running, its limit "
            "(FERRY_MAX_OUTSTANDING_JOBS); submit more as they finish",
            {"Retry-After": str(QUOTA_RETRY_AFTER_S)},
        )


def resolve_model(
    catalog: dict[str, ModelSpec],
    model: str,
    version: int | None = None,
    live: LiveVersions | None = None,
) -> tuple[ModelSpec, int | None]:
    """The model a request names (``name`` or ``name@N``) and the version it asks for.

    ``live`` gives the versions and the active one as they are now (default:
    as they were at start-up). A version that exists but is not the active
    one is refused: workers serve the active version.
    """
    name, at, suffix = model.partition("@")
    if at:
        if not re.fullmatch(r"[1-9][0-9]{0,8}", suffix):
            raise ApiError(
                422, "invalid_request", f"model: {model!r} must be 'name' or 'name@N' (N a version)"
            )
        if version is not None and version != int(suffix):
            raise ApiError(
                422, "invalid_request", f"version: {version} differs from the model's @{suffix}"
            )
        version = int(suffix)
    spec = catalog.get(name)
    if spec is None:
        known = ", ".join(sorted(catalog))
        raise ApiError(422, "invalid_request", f"model: unknown model {name!r} (known: {known})")
    if version is None:
        return spec, None
    numbers, active = live.of(spec) if live is not None else (spec.versions, spec.active_version)
    if version not in numbers:
        versions = ", ".join(map(str, numbers))
        raise ApiError(
            422,
            "invalid_request",
            f"version: {name} has no version {version} (versions: {versions})",
        )
    if version != active:
        raise ApiError(
            422,
            "invalid_request",
            f"version: {name}@{version} takes no jobs; its active version is {active}",
        )
    return spec, version


def submit_job(
    session: Session,
    client: redis.Redis,
    prefix: str,
    catalog: dict[str, ModelSpec],
    key: ApiKey,
    body: JobCreate,
    idempotency_key: str | None,
    request_id: str | None,
    requeue_within_s: float = 90.0,
    check_callback: Callable[[str], None] | None = None,
    max_outstanding: int | None = None,
    max_metadata_bytes: int = 16_384,
    max_json_depth: int = MAX_JSON_DEPTH,
    live: LiveVersions | None = None,
) -> Submitted:
    """Validate, commit, enqueue.

    If the enqueue fails (Redis down) the committed job is still accepted: the
    reconciler enqueues it within ``requeue_within_s`` once Redis is back. A job
    whose deadline is sooner than that could only expire, so it is taken back
    and refused with 503 instead.
    """
    spec, requested_version = resolve_model(catalog, body.model, body.version, live)
    for field, value in (("input", body.input), ("metadata", body.metadata)):
        problem = nesting_problem(value, max_json_depth)
        if problem:
            raise ApiError(422, "invalid_request", f"{field}: must not contain {problem}")
    problem = metadata_problem(body.metadata, max_metadata_bytes)
    if problem:
        raise ApiError(422, "invalid_request", f"metadata: {problem}")
    try:
        validated = spec.validate(body.input)
    except InputError as exc:
        raise ApiError(422, "invalid_request", f"{exc.field}: {exc.message}") from exc

    if body.idempotency_key and idempotency_key and body.idempotency_key != idempotency_key:
        raise ApiError(
            422, "invalid_request", "idempotency_key: differs from the Idempotency-Key header"
        )
    idem = body.idempotency_key or idempotency_key
    if idem:
        existing = _by_idempotency_key(session, key.id, idem)
        if existing is not None:
            return _replay(existing, body, validated.input)
    # A replay above is answered whatever the quota; only new work counts against it.
    check_job_quota(session, key, max_outstanding)
    if body.callback_url and check_callback is not None:
        check_callback(body.callback_url)

    estimate_ms = _estimate_wait_ms(
        client, prefix, spec.name, body.priority, validated.cost, key.id
    )
    if body.deadline_ms is not None and estimate_ms is not None and estimate_ms > body.deadline_ms:
        # Refuse now rather than accept a job that would only expire in the queue.
        raise ApiError(
            429,
            "deadline_unattainable",
            f"deadline_ms: {body.deadline_ms} ms cannot be met; with the queue ahead "
            f"this job would finish in about {estimate_ms:.0f} ms",
            estimated_wait_ms=estimate_ms,
        )

    now = utcnow()
    job = Job(
        id=str(uuid.uuid4()),
        api_key_id=key.id,
        model=spec.name,
        requested_version=requested_version,
        priority=body.priority,
        status="queued",
        input=validated.input,
        cost=validated.cost,
        attempts=0,
        created_at=now,
        deadline_at=now + dt.timedelta(milliseconds=body.deadline_ms) if body.deadline_ms else None,
        callback_url=body.callback_url,
        idempotency_key=idem,
        metadata_=body.metadata,
        request_id=request_id,
    )
    session.add(job)
    try:
        session.commit()  # durable before anything is queued or answered
    except IntegrityError:
        session.rollback()
        existing = _by_idempotency_key(session, key.id, idem) if idem else None
        if existing is None:
            raise
        return _replay(existing, body, validated.input)

    message = JobMessage(
        job_id=job.id,
        lane=job.priority,
        cost=job.cost,
        enqueued_at_ms=_ms(now),
        deadline_at_ms=_ms(job.deadline_at) if job.deadline_at else None,
        request_id=request_id,
        tenant=key.id,
        version=job.requested_version,
    )
    try:
        Scripts(client).enqueue(client, prefix, job.model, message)
    except redis.RedisError as exc:
        if body.deadline_ms is not None and body.deadline_ms < requeue_within_s * 1000:
            log.warning(
                "enqueue failed; job with a short deadline refused",
                extra={"job_id": job.id, "error_type": type(exc).__name__},
            )
            session.execute(delete(Job).where(Job.id == job.id, Job.status == "queued"))
            session.commit()
            raise ApiError(
                503, "unavailable", "the queue is unavailable; retry shortly", {"Retry-After": "2"}
            ) from exc
        # The row is committed, so the job is accepted: the reconciler gives it
        # its stream entry once Redis is back (docs/architecture.md §4).
        log.warning(
            "enqueue failed; the reconciler will enqueue the job",
            extra={"job_id": job.id, "error_type": type(exc).__name__},
        )
        return Submitted(job, False, None)
    return Submitted(job, False, estimate_ms)


def _by_idempotency_key(session: Session, key_id: str, idem: str) -> Job | None:
    return session.scalars(
        select(Job).where(Job.api_key_id == key_id, Job.idempotency_key == idem)
    ).one_or_none()


def _replay(existing: Job, body: JobCreate, validated_input: object) -> Submitted:
    if existing.model != body.model or existing.input != validated_input:
        raise ApiError(409, "conflict", "idempotency_key: already used for a different request")
    return Submitted(existing, True, None)


def _estimate_wait_ms(
    client: redis.Redis, prefix: str, model: str, lane: str, cost: int, tenant: str
) -> float | None:
    """From what the model's workers learned and the queue ahead (None: nothing learned yet)."""
    try:
        estimate = ModelEstimate.from_hash(model_stats(client, prefix, model))
        if estimate is None:  # no worker has published: spare the depth reads
            return None
        depths = _recent_depths(client, prefix, model)
        workers = live_workers(client, prefix, model)
    except redis.RedisError:
        return None
    return round(
        estimate_wait_s(estimate, jobs_ahead(depths, lane, tenant), cost, workers) * 1000.0, 1
    )


# The queue's shape is read once per DEPTHS_TTL_S per API process and model,
# not at every submission: with many tenants it is a command per stream.
DEPTHS_TTL_S = 0.25
_depths: weakref.WeakKeyDictionary[
    redis.Redis, dict[tuple[str, str], tuple[float, dict[str, dict[str, int]]]]
] = weakref.WeakKeyDictionary()


def _recent_depths(client: redis.Redis, prefix: str, model: str) -> dict[str, dict[str, int]]:
    now = time.monotonic()
    cache = _depths.setdefault(client, {})
    cached = cache.get((prefix, model))
    if cached is not None and now - cached[0] < DEPTHS_TTL_S:
        return cached[1]
    depths = tenant_depths(client, prefix, model)
    cache[(prefix, model)] = (now, depths)
    return depths


def _ms(value: dt.datetime) -> int:
    return int(value.timestamp() * 1000)


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


def owned(session: Session, kind: type[Owned], key: ApiKey, row_id: str, noun: str) -> Owned:
    """The calling key's row of this kind, or a 404.

    Another key's row looks exactly like a missing one.
    """
    row = session.get(kind, row_id) if is_uuid(row_id) else None
    if row is None or row.api_key_id != key.id:
        raise ApiError(404, "not_found", f"no {noun} {row_id!r}")
    return row


def get_job(session: Session, key: ApiKey, job_id: str) -> Job:
    return owned(session, Job, key, job_id, "job")


def cancel_job(session: Session, key: ApiKey, job_id: str, kick: Kick | None = None) -> Job:
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
        raise ApiError(
            409, "conflict", f"job {job.id} is {job.status}; only a queued job can be cancelled"
        )
    if deliveries and kick is not None:
        kick(deliveries)
    return job


def deliveries_of(session: Session, jobs: Sequence[Job]) -> dict[str, WebhookDelivery]:
    """The webhook delivery of each of these jobs that has one, in one query."""
    ids = [job.id for job in jobs if job.callback_url and job.status in TERMINAL_STATUSES]
    if not ids:
        return {}
    rows = session.scalars(select(WebhookDelivery).where(WebhookDelivery.job_id.in_(ids)))
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
    """Send the job's webhook again, from the start of the schedule, with the same webhook-id."""
    job = get_job(session, key, job_id)
    if not job.callback_url:
        raise ApiError(409, "conflict", f"job {job.id} has no callback_url")
    if job.status not in TERMINAL_STATUSES:
        raise ApiError(
            409, "conflict", f"job {job.id} is {job.status}; its webhook is sent when it ends"
        )
    now = utcnow()
    delivery = session.scalars(
        select(WebhookDelivery).where(WebhookDelivery.job_id == job.id).with_for_update()
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


def is_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


def is_terminal(job: Job) -> bool:
    return job.status in TERMINAL_STATUSES


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
        attempt_log=[
            AttemptResource(
                number=a.number,
                started_at=a.started_at,
                duration_ms=a.duration_ms,
                status_code=a.status_code,
                error=a.error,
            )
            for a in attempts
        ],
    )
