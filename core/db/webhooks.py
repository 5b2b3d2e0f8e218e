"""Webhook events: the delivery rows, their payloads, and the retry schedule.

When a job reaches a terminal state and has a ``callback_url``, the same
transaction that writes the outcome adds a :class:`~core.db.schema.WebhookDelivery`
row (an outbox): a crash right after the commit cannot lose the event. The
Celery worker sends it (``workers/tasks/webhooks.py``); the schedule of its retries
is stored on the row and walked by Celery beat.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.backfills import backfill_resource
from core.db.resources import iso, job_resource
from core.db.schema import TERMINAL_STATUSES, Backfill, Job, WebhookDelivery
from core.streams.target import RedisTarget

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

DELIVER_TASK = "ferry.webhooks.deliver"
DISPATCH_TASK = "ferry.webhooks.dispatch"


def new_delivery_id() -> str:
    return "msg_" + uuid.uuid4().hex


# The events a job may ask for in ``callback_events``; without it, terminal only.
JOB_EVENTS = ("started", "progress", "terminal")
# What a terminal event is called: one a job, sent once.
TERMINAL_EVENT_TYPES = tuple(f"job.{status}" for status in TERMINAL_STATUSES)


def event_type(job: Job) -> str:
    return f"job.{job.status}"


def wants(callback_events: str | None, event: str) -> bool:
    """Whether a job whose ``callback_events`` column holds this asked for ``event``."""
    if callback_events is None:
        return event == "terminal"
    return event in callback_events.split(",")


def payload(kind: str, data: dict[str, Any], at: dt.datetime) -> str:
    """The exact body sent on every attempt (compact JSON, UTF-8)."""
    return json.dumps(
        {"type": kind, "timestamp": iso(at), "data": data},
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )


def add_job_deliveries(session: Session, job_ids: Sequence[str], now: dt.datetime) -> list[str]:
    """In the caller's transaction: one delivery for each of these jobs that is
    terminal and has a callback URL (and has none yet). Returns the new ids."""
    if not job_ids:
        return []
    found = session.scalars(
        select(Job).where(
            Job.id.in_(job_ids),
            Job.callback_url.is_not(None),
            Job.status.in_(TERMINAL_STATUSES),
        )
    ).all()
    jobs = [job for job in found if wants(job.callback_events, "terminal")]
    if not jobs:
        return []
    have = set(
        session.scalars(
            select(WebhookDelivery.job_id).where(
                WebhookDelivery.job_id.in_([j.id for j in jobs]),
                WebhookDelivery.event_type.in_(TERMINAL_EVENT_TYPES),
            )
        )
    )
    created = []
    for job in jobs:
        if job.id in have:
            continue
        assert job.callback_url is not None
        created.append(
            _add(
                session,
                job.api_key_id,
                job.callback_url,
                event_type(job),
                job_resource(job),
                now,
                job_id=job.id,
            )
        )
    return created


def add_started_deliveries(
    session: Session, jobs: Sequence[tuple[Any, int]], now: dt.datetime
) -> list[str]:
    """In the caller's transaction (the claim's): a ``job.started`` delivery for each of these
    jobs (a row with ``id``, ``api_key_id``, ``model``, ``callback_url`` and
    ``callback_events``, and the attempt it starts) that asked for it. One an attempt: a
    job taken over after its worker died starts again."""
    created = []
    for job, attempt in jobs:
        if job.callback_url and wants(job.callback_events, "started"):
            data = {
                "id": job.id,
                "model": job.model,
                "status": "running",
                "attempt": attempt,
                "started_at": iso(now),
            }
            created.append(
                _add(
                    session,
                    job.api_key_id,
                    job.callback_url,
                    "job.started",
                    data,
                    now,
                    ordinal=attempt,
                    job_id=job.id,
                )
            )
    return created


def add_progress_deliveries(
    session: Session, progress: dict[str, tuple[int, int]], now: dt.datetime
) -> list[str]:
    """In the caller's transaction: a ``job.progress`` delivery for each running job of
    ``progress`` (job id: its tokens so far and its max_tokens) that asked for them."""
    if not progress:
        return []
    jobs = session.execute(
        select(Job.id, Job.api_key_id, Job.model, Job.callback_url, Job.callback_events).where(
            Job.id.in_(list(progress)), Job.status == "running", Job.callback_url.is_not(None)
        )
    ).all()
    created = []
    for job in jobs:
        if not wants(job.callback_events, "progress"):
            continue
        tokens, max_tokens = progress[job.id]
        data = {
            "id": job.id,
            "model": job.model,
            "status": "running",
            "tokens": tokens,
            "max_tokens": max_tokens,
        }
        created.append(
            _add(
                session,
                job.api_key_id,
                job.callback_url,
                "job.progress",
                data,
                now,
                ordinal=tokens,
                job_id=job.id,
            )
        )
    return created


def add_backfill_delivery(session: Session, backfill: Backfill, now: dt.datetime) -> str | None:
    """In the caller's transaction: the ``backfill.<status>`` event, if it has a callback URL."""
    if not backfill.callback_url:
        return None
    kind = f"backfill.{backfill.status}"
    exists = session.scalars(
        select(WebhookDelivery.id).where(
            WebhookDelivery.backfill_id == backfill.id, WebhookDelivery.event_type == kind
        )
    ).first()
    if exists is not None:
        return None
    return _add(
        session,
        backfill.api_key_id,
        backfill.callback_url,
        kind,
        backfill_resource(backfill),
        now,
        backfill_id=backfill.id,
    )


def _add(
    session: Session,
    key_id: str,
    url: str,
    kind: str,
    data: dict[str, Any],
    now: dt.datetime,
    ordinal: int = 0,
    **subject: str,
) -> str:
    """A delivery due now, its body frozen; ``subject`` is job_id= or backfill_id=."""
    delivery = WebhookDelivery(
        id=new_delivery_id(),
        api_key_id=key_id,
        event_type=kind,
        ordinal=ordinal,
        url=url,
        payload=payload(kind, data, now),
        status="pending",
        attempts=0,
        step=0,
        next_attempt_at=now,
        created_at=now,
        **subject,
    )
    session.add(delivery)
    return delivery.id


def next_delay_s(
    schedule: Sequence[float],
    step: int,
    retry_after_s: float | None = None,
    jitter: float = 0.0,
    unit: float = 0.5,
) -> float | None:
    """Seconds until the attempt after ``step`` failed ones (None: the schedule is spent).

    ``Retry-After`` is honoured when it asks for longer than the schedule, up to
    the schedule's longest delay. ``jitter`` spreads each delay by up to that
    fraction either way, driven by ``unit`` in [0, 1) (pass ``random.random()``),
    so deliveries that failed together do not all come back together.
    """
    if step >= len(schedule):
        return None
    delay = schedule[step]
    if retry_after_s is not None and retry_after_s > delay:
        delay = min(retry_after_s, max(schedule))
    return max(0.0, delay * (1.0 + jitter * (2.0 * unit - 1.0)))


def parse_retry_after(value: str | None, now: dt.datetime) -> float | None:
    """``Retry-After`` as seconds from ``now``: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # not "²", which isdigit() also accepts
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return max(0.0, (when - now).total_seconds())


def celery_queue(prefix: str) -> str:
    """The queue Ferry's Celery worker consumes (its tasks and webhook attempts)."""
    return f"{prefix}.celery"


class DeliveryKicker:
    """Queues the first attempt of new deliveries at once.

    Losing a kick loses nothing: the delivery is a row that is due, and beat
    dispatches due rows every ``webhook_dispatch_interval_s``. So a failure
    here is logged, never raised into the job path.
    """

    def __init__(self, redis: RedisTarget, prefix: str) -> None:
        # Celery's broker is Ferry's Redis, reached as every other client reaches it.
        self.broker_url, self.transport_options = redis.broker()
        self.queue = celery_queue(prefix)
        self._app: Celery | None = None
        self._lock = threading.Lock()  # called from the loop's and its recording thread

    def __call__(self, delivery_ids: Sequence[str]) -> None:
        if not delivery_ids:
            return
        try:
            with self._lock:
                if self._app is None:
                    # Imported here: every API process imports this module, and
                    # Celery's app machinery (about 0.17 CPU seconds to import) is
                    # wasted on one that never queues a delivery.
                    from celery import Celery

                    self._app = Celery(
                        "ferry-producer", broker=self.broker_url, set_as_current=False
                    )
                    if self.transport_options:
                        self._app.conf.broker_transport_options = self.transport_options
            for delivery_id in delivery_ids:
                self._app.send_task(DELIVER_TASK, args=[delivery_id], queue=self.queue, retry=False)
        except Exception as exc:
            log.warning(
                "webhook delivery not queued now; beat will dispatch it",
                extra={"count": len(delivery_ids), "error_type": type(exc).__name__},
            )

    def close(self) -> None:
        if self._app is not None:
            self._app.close()
            self._app = None
