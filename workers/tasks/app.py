"""The Celery app: webhook deliveries, maintenance (purge, reconciler) and backfill feeding.

Built by :func:`create_celery` from the settings; ``ferry celery worker`` and
``ferry celery beat`` start it, so nothing is configured at import time.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import uuid

from celery import Celery
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import (
    BACKFILL_DONE,
    DELIVERY_DONE,
    TERMINAL_STATUSES,
    Backfill,
    DatabaseSettings,
    FilePart,
    Job,
    OpenAIBatch,
    StoredFile,
    WebhookAttempt,
    WebhookDelivery,
    engine_for,
    make_sessionmaker,
)
from core.db.webhooks import DELIVER_TASK, DISPATCH_TASK, DeliveryKicker, celery_queue
from core.ops.metrics import WEBHOOK_ATTEMPTS
from core.streams.broker import celery_on_broker
from core.streams.target import RedisSettings, RedisTarget, ServerClock
from workers.tasks.feeder import Feeder
from workers.tasks.locks import first_in, release, renew
from workers.tasks.reconcile import reconcile
from workers.tasks.webhook_hosts import HostGate
from workers.tasks.webhooks import (
    DeliveryConfig,
    WebhookSettings,
    attempt_delivery,
    dispatch_due,
)

log = logging.getLogger(__name__)

PURGE_TASK = "ferry.maintenance.purge_results"
FEED_TASK = "ferry.backfills.feed"
RECONCILE_TASK = "ferry.maintenance.reconcile"
# Renewed before each model and each page: a run that dies (its worker killed, or its
# Redis failing over after the lock had reached the replica) holds the reconciler off only
# this long, which matters most just after a failover, the entries it lost waiting on it.
RECONCILE_LOCK_S = 15
# Beat sends its ticks with an expiry that the receiving worker judges by its own clock: a
# short one drops every tick at a worker whose clock is ahead by more (an NTP step, a
# drifting host), and due webhooks wait for that clock. This one tolerates a host minutes
# off and still bounds what piles up while no worker runs (a quarter of an hour of ticks);
# a dispatch that finds another ran within half its interval returns at once.
BEAT_EXPIRES_S = 900.0


class Database:
    """One engine per process, made on first use (never inherited across a fork)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pid: int | None = None
        self._sessions: sessionmaker[Session] | None = None

    def sessions(self) -> sessionmaker[Session]:
        if self._sessions is None or self._pid != os.getpid():
            self._sessions = make_sessionmaker(engine_for(self.settings.section(DatabaseSettings)))
            self._pid = os.getpid()
        return self._sessions


def reconcile_streams(settings: Settings) -> int:
    """One reconciler run (one at a time across every Celery worker, by a Redis lock)."""
    client = RedisTarget.of(settings.section(RedisSettings)).client(decode_responses=True)
    engine = engine_for(settings.section(DatabaseSettings))
    lock = f"{settings.key_prefix}:reconcile:lock"
    token = uuid.uuid4().hex
    try:
        # Kept while the run goes on, and released only by its holder.
        if not client.set(lock, token, nx=True, ex=RECONCILE_LOCK_S):
            return 0  # another run is in progress
        try:
            return reconcile(
                make_sessionmaker(engine),
                client,
                settings.key_prefix,
                settings.reconcile_grace_s,
                held=lambda: renew(client, lock, token, RECONCILE_LOCK_S * 1000),
            )
        finally:
            release(client, lock, token)
    finally:
        engine.dispose()
        client.close()


def purge_results(settings: Settings, now: dt.datetime | None = None) -> int:
    """Delete terminal jobs that finished more than ``result_ttl_s`` ago (a backfill's only
    once it has finished: its results are read whole), finished backfills, and the OpenAI
    batches and files they leave behind; and uploads past their expiry or cut off."""
    moment = now or dt.datetime.now(dt.UTC)
    cutoff = moment - dt.timedelta(seconds=settings.result_ttl_s)
    engine = engine_for(settings.section(DatabaseSettings))
    try:
        with make_sessionmaker(engine).begin() as session:
            unfinished = select(Backfill.id).where(Backfill.status.not_in(BACKFILL_DONE))
            result = session.execute(
                delete(Job).where(
                    Job.status.in_(TERMINAL_STATUSES),
                    Job.finished_at < cutoff,
                    Job.backfill_id.is_(None) | Job.backfill_id.not_in(unfinished),
                )
            )
            count = int(result.rowcount)
            finished = (
                select(WebhookDelivery.id)
                .where(WebhookDelivery.status.in_(DELIVERY_DONE))
                .where(WebhookDelivery.finished_at < cutoff)
            )
            session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(finished)))
            session.execute(
                delete(WebhookDelivery).where(
                    WebhookDelivery.status.in_(DELIVERY_DONE), WebhookDelivery.finished_at < cutoff
                )
            )
            session.execute(
                delete(Backfill).where(
                    Backfill.status.in_(BACKFILL_DONE), Backfill.finished_at < cutoff
                )
            )
            purge_openai_files(session, moment, cutoff, settings.backfill_stale_upload_s)
    finally:
        engine.dispose()
    log.info("purged expired results", extra={"count": count})
    return count


def purge_openai_files(
    session: Session, now: dt.datetime, cutoff: dt.datetime, stale_upload_s: float
) -> None:
    """The OpenAI batches whose backfill is gone (or that failed before having one, long
    ago), their output files, and uploads expired or cut off mid-way, with their parts."""
    orphans = select(OpenAIBatch.id).where(
        (OpenAIBatch.backfill_id.is_not(None) & OpenAIBatch.backfill_id.not_in(select(Backfill.id)))
        | (OpenAIBatch.backfill_id.is_(None) & (OpenAIBatch.created_at < cutoff))
    )
    batch_ids = list(session.scalars(orphans))
    stale = now - dt.timedelta(seconds=stale_upload_s)
    files = select(StoredFile.id).where(
        StoredFile.batch_id.in_(batch_ids)
        | (StoredFile.expires_at.is_not(None) & (StoredFile.expires_at < now))
        | (
            (StoredFile.purpose == "batch")
            & StoredFile.bytes.is_(None)
            & (StoredFile.created_at < stale)
        )
    )
    file_ids = list(session.scalars(files))
    if file_ids:
        session.execute(delete(FilePart).where(FilePart.file_id.in_(file_ids)))
        session.execute(delete(StoredFile).where(StoredFile.id.in_(file_ids)))
    if batch_ids:
        session.execute(delete(OpenAIBatch).where(OpenAIBatch.id.in_(batch_ids)))


def create_celery(settings: Settings) -> Celery:
    try:
        target = RedisTarget.of(settings.section(RedisSettings))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    app = celery_on_broker(target)
    app.set_current()
    app.conf.update(
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # Ferry's JSON logging stays in place (configured by `ferry celery`).
        worker_hijack_root_logger=False,
        task_default_queue=celery_queue(settings.key_prefix),
        beat_schedule={
            "feed-backfills": {
                "task": FEED_TASK,
                "schedule": settings.backfill_feed_interval_s,
                "options": {"expires": max(settings.backfill_feed_interval_s, BEAT_EXPIRES_S)},
            },
            "dispatch-webhooks": {
                "task": DISPATCH_TASK,
                "schedule": settings.webhook_dispatch_interval_s,
                "options": {"expires": max(settings.webhook_dispatch_interval_s, BEAT_EXPIRES_S)},
            },
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

    database = Database(settings)
    config = DeliveryConfig.of(settings.section(WebhookSettings))
    # Deliveries are due, leased, held and signed by the Redis server's clock, not this
    # host's: a host clock stepped ahead would sign what receivers refuse as too new, and
    # put every retry off by the step.
    server_clock = ServerClock(target.client(decode_responses=True))

    def now() -> dt.datetime:
        return dt.datetime.fromtimestamp(server_clock(), dt.UTC)

    # Per receiver, across every Celery worker: how many attempts at once, and a hold on one
    # that stopped answering (its client connects at its first use).
    gate = HostGate(
        target.client(decode_responses=True),
        settings.key_prefix,
        concurrency=settings.webhook_receiver_concurrency,
        failures=settings.webhook_receiver_failures,
        hold_s=settings.webhook_receiver_hold_s,
        lease_s=settings.webhook_timeout_s + settings.webhook_lease_margin_s,
        clock=server_clock,
    )
    # A queued attempt is not queued again before this: long enough for a
    # backlog to drain, short enough that a lost task costs little.
    hold_s = max(60.0, 4 * settings.webhook_timeout_s)
    # One dispatch per half interval, however many beat ticks waited in the queue.
    ticks = target.client(decode_responses=True)
    dispatched_key = f"{settings.key_prefix}:webhooks:dispatched"
    dispatch_gap_ms = max(1, int(settings.webhook_dispatch_interval_s * 500))

    # Each task is one attempt; retries are rows in the database that beat
    # dispatches when due, never Celery countdowns (Redis would redeliver
    # those early, after its visibility timeout).
    @app.task(name=DELIVER_TASK, shared=False, ignore_result=True)
    def _deliver(delivery_id: str) -> str | None:
        outcome = attempt_delivery(database.sessions(), delivery_id, config, gate=gate, clock=now)
        if outcome is not None:
            WEBHOOK_ATTEMPTS.labels(outcome).inc()
        return outcome

    @app.task(name=DISPATCH_TASK, shared=False, ignore_result=True)
    def _dispatch() -> int:
        if not first_in(ticks, dispatched_key, dispatch_gap_ms):
            return 0  # a tick that waited in the queue: another dispatch just ran
        return dispatch_due(
            database.sessions(),
            lambda delivery_id: _deliver.apply_async(args=[delivery_id], retry=False),
            now(),
            hold_s,
        )

    # Made once per process (neither connects before it is used).
    feed_client = target.client(decode_responses=True)
    kick = DeliveryKicker(target, settings.key_prefix)

    # One run at a time (a Redis lock inside); the others return at once.
    # One feeder per process, so its sweep of cut-off uploads keeps its pace
    # across runs instead of running at every beat tick.
    feeders: list[Feeder] = []

    @app.task(name=FEED_TASK, shared=False, ignore_result=True)
    def _feed() -> int:
        if not feeders:
            feeders.append(
                Feeder(
                    database.sessions(),
                    feed_client,
                    settings.key_prefix,
                    outstanding=settings.backfill_outstanding,
                    chunk=settings.backfill_feed_chunk,
                    stale_upload_s=settings.backfill_stale_upload_s,
                    kick=kick,
                )
            )
        return feeders[0].run(settings.backfill_feed_budget_s)

    return app
