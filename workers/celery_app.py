"""The Celery app: maintenance (purge, reconciler) now; webhooks and backfill feeding later.

Built by :func:`create_celery` from the settings; ``ferry celery worker`` and
``ferry celery beat`` start it, so nothing is configured at import time.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid

import redis
from celery import Celery
from sqlalchemy import delete

from core.db import TERMINAL_STATUSES, Job, make_engine, make_sessionmaker
from core.settings import Settings
from workers.reconcile import reconcile

log = logging.getLogger(__name__)

PURGE_TASK = "ferry.maintenance.purge_results"
RECONCILE_TASK = "ferry.maintenance.reconcile"
RECONCILE_LOCK_S = 600
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def reconcile_streams(settings: Settings) -> int:
    """One reconciler run (one at a time across every Celery worker, by a Redis lock)."""
    assert settings.redis_url
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    engine = make_engine(settings.sqlalchemy_url)
    lock = f"{settings.key_prefix}:reconcile:lock"
    token = uuid.uuid4().hex
    try:
        # Held well past a slow run, and released only by its holder.
        if not client.set(lock, token, nx=True, ex=RECONCILE_LOCK_S):
            return 0  # another run is in progress
        try:
            return reconcile(
                make_sessionmaker(engine), client, settings.key_prefix, settings.reconcile_grace_s
            )
        finally:
            client.eval(_RELEASE, 1, lock, token)
    finally:
        engine.dispose()
        client.close()


def purge_results(settings: Settings, now: dt.datetime | None = None) -> int:
    """Delete terminal jobs that finished more than ``result_ttl_s`` ago."""
    cutoff = (now or dt.datetime.now(dt.UTC)) - dt.timedelta(seconds=settings.result_ttl_s)
    engine = make_engine(settings.sqlalchemy_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            result = session.execute(
                delete(Job).where(Job.status.in_(TERMINAL_STATUSES), Job.finished_at < cutoff)
            )
            count = int(result.rowcount)
    finally:
        engine.dispose()
    log.info("purged expired results", extra={"count": count})
    return count


def create_celery(settings: Settings) -> Celery:
    if not settings.redis_url:
        raise SystemExit("FERRY_REDIS_URL is not set (`ferry up` sets it for Celery)")
    app = Celery("ferry", broker=settings.redis_url, set_as_current=True)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # Ferry's JSON logging stays in place (configured by `ferry celery`).
        worker_hijack_root_logger=False,
        task_default_queue=f"{settings.key_prefix}.celery",
        beat_schedule={
            "purge-results": {"task": PURGE_TASK, "schedule": settings.purge_interval_s},
            "reconcile": {"task": RECONCILE_TASK, "schedule": settings.reconcile_interval_s},
        },
        timezone="UTC",
    )

    # Tasks close over this app's settings; shared=False keeps two apps in one
    # process (tests) from fighting over the task name.
    @app.task(name=PURGE_TASK, shared=False)
    def _purge() -> int:
        return purge_results(settings)

    # A run that finds Redis down is simply skipped: the next one catches up.
    @app.task(name=RECONCILE_TASK, shared=False, ignore_result=True)
    def _reconcile() -> int:
        return reconcile_streams(settings)

    return app
