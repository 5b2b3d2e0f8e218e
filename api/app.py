"""The FastAPI application, built from the settings by :func:`create_app`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api.admin import routes as admin
from api.backfills import routes as backfills
from api.batches import routes as batches
from api.breaker import Breaker, BreakerPolicy
from api.completions import CompletionHub
from api.errors import install_error_handlers
from api.groups import GroupStage
from api.hotpath import HotRoutes
from api.jobs import routes as jobs
from api.jobs import webhook_routes as webhooks
from api.jobs.reads import GenerationProgress, GroupRead, JobReader, LoopReader
from api.jobs.service import callback_checker
from api.jobs.submissions import GroupCommit, GroupWriter
from api.jobs.tails import StreamTails
from api.keycache import KeyCache
from api.limits import RequestLimits
from api.middleware import BodyLimitMiddleware, EdgeMiddleware
from api.models import routes as models
from api.oip import routes as oip
from api.openai import routes as openai
from api.state import ApiSettings, AppState, install
from backends.catalog import LiveVersions, build_catalog
from core.config.settings import Settings
from core.db.schema import DatabaseSettings, engine_for, make_sessionmaker, read_only
from core.db.webhooks import DeliveryKicker
from core.ops.metrics import AutoscaleSettings, Scalers
from core.ops.urlguard import Resolver, UrlPolicy, system_resolver
from core.streams.bounds import QueueBound
from core.streams.protocol import done_channel
from core.streams.target import SERVER_CLOCK_RESYNC_S, RedisSettings, RedisTarget, ServerClock


async def _follow_server_clock(clock: ServerClock) -> None:
    """Read the Redis server's clock every SERVER_CLOCK_RESYNC_S, off the event loop."""
    while True:
        await asyncio.to_thread(clock.resync)
        await asyncio.sleep(SERVER_CLOCK_RESYNC_S)


def create_app(settings: Settings, resolve: Resolver = system_resolver) -> FastAPI:
    """The API. ``resolve`` answers DNS for the callback URL check (tests pass their own)."""
    target = RedisTarget.of(settings.section(RedisSettings))
    # Before anything starts: a repository Ferry cannot serve stops the API with its problems.
    catalog = build_catalog(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = engine_for(settings.section(DatabaseSettings))
        sessions = make_sessionmaker(engine)
        reads = read_only(engine)  # one pool with the engine; reads without transactions
        client = target.client(decode_responses=True, socket_timeout=5, socket_connect_timeout=2)
        hub = CompletionHub(
            target.async_client(decode_responses=True),
            done_channel(settings.key_prefix),
        )
        limits = RequestLimits(
            target, settings.key_prefix, settings.rate_limit, settings.auth_failure_limit
        )
        hub.start()
        limits.start()
        tails = StreamTails(target, settings.key_prefix)
        writer = GroupWriter(
            sessions,
            client,
            settings.key_prefix,
            max_outstanding=settings.max_outstanding_jobs,
            requeue_within_s=settings.reconcile_grace_s + settings.reconcile_interval_s,
            bound=QueueBound(settings.queue_max_jobs, settings.queue_max_bytes),
            breaker=Breaker(
                BreakerPolicy(
                    settings.breaker_latency_factor,
                    settings.breaker_memory_fraction,
                    settings.breaker_cool_s,
                )
            ),
            accepted=hub.accepted,
            taken_back=hub.ended,
        )
        group_commit: GroupCommit = GroupStage(
            "group-commit",
            writer.write,
            max_items=settings.submit_group_max,
            wait_s=settings.submit_group_wait_ms / 1000.0,
            # SQLite writes one transaction at a time; PostgreSQL overlaps two groups.
            workers=1 if engine.dialect.name == "sqlite" else 2,
        )
        # Reads do not wait for company: a group is what queued during the last read.
        progress = GenerationProgress(client, settings.key_prefix, writer.views)
        # PostgreSQL's reads from the event loop (no thread hop a group); SQLite's in threads.
        reader: JobReader | LoopReader = (
            LoopReader.of(engine, progress)
            if engine.dialect.name == "postgresql"
            else JobReader(reads, progress)
        )
        group_read: GroupRead = GroupStage(
            "group-read",
            reader.read,
            max_items=settings.submit_group_max,
            wait_s=0,
            workers=2,
        )
        group_read.start()
        group_commit.start()
        kicker = DeliveryKicker(target, settings.key_prefix)
        # Jobs are stamped (created_at, deadline_at) by the Redis server's clock, as workers
        # time their deadlines: a step of this host's clock would move every deadline it
        # promises. Read in the background: a submission never waits on Redis for it.
        clock = ServerClock(client)
        clock_task = asyncio.create_task(_follow_server_clock(clock))
        install(
            app,
            AppState(
                settings=settings.section(ApiSettings),
                engine=engine,
                sessions=sessions,
                reads=make_sessionmaker(reads),
                keys=KeyCache(settings.key_cache_s),
                scalers=Scalers(settings.section(AutoscaleSettings)),
                catalog=catalog,
                versions=LiveVersions(settings, sessions, settings.model_poll_s),
                target=target,
                redis=client,
                hub=hub,
                tails=tails,
                limits=limits,
                clock=clock,
                group_read=group_read,
                reader=reader,
                group_commit=group_commit,
                kick=kicker,
                check_callback=callback_checker(
                    UrlPolicy.of(settings.webhook_allow_http, settings.webhook_allowed_networks),
                    resolve,
                ),
            ),
        )
        grpc_server = None
        if settings.grpc_port:
            # Imported only here: an API without gRPC never loads grpcio.
            from api.oip.grpc import GrpcSettings, start_server

            grpc_server = await start_server(app, settings.section(GrpcSettings))
        try:
            yield
        finally:
            if grpc_server is not None:
                # Calls in flight get as long as HTTP's long-polls to finish.
                await grpc_server.stop(settings.max_wait_s)
            clock_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await clock_task
            await group_commit.stop()
            await group_read.stop()
            await reader.close()
            await limits.stop()
            kicker.close()
            await tails.stop()
            await hub.stop()
            client.close()
            engine.dispose()

    app = FastAPI(
        title="Ferry",
        version="1",
        summary="Asynchronous inference jobs: submit, batch on GPUs, poll or get a webhook.",
        lifespan=lifespan,
        docs_url="/docs" if settings.docs_enabled else None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.docs_enabled else None,
        # FastAPI's own OpenTelemetry off: Ferry traces requests itself (api.middleware,
        # when OTEL_EXPORTER_OTLP_ENDPOINT is set), and FastAPI's would add a second span
        # to each where a process sets a global provider, record validation failures
        # with the payloads they quote, and look up the global providers on every
        # request meanwhile.
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    install_error_handlers(app)
    app.include_router(jobs.router)
    app.include_router(backfills.router)
    app.include_router(webhooks.router)
    app.include_router(models.router)
    app.include_router(admin.router)
    app.include_router(openai.router)
    app.include_router(oip.router)
    app.include_router(batches.router)
    # Innermost: the hottest routes' requests go straight to their handlers.
    app.add_middleware(HotRoutes, owner=app, routes=jobs.HOT)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        # A batch input file comes in a multipart body: room for its part headers.
        streamed={
            "/v1/backfills": settings.backfill_max_bytes,
            "/v1/files": settings.backfill_max_bytes + 64 * 1024,
        },
    )
    if settings.cors_origins:
        # Off unless configured: browsers on other origins get no access at all.
        # Inside the edge, so that the preflight answers it makes itself carry the
        # request id and the security headers too.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=[
                "Authorization",
                "Content-Type",
                "Idempotency-Key",
                "X-Request-ID",
                "X-Ferry-Priority",
            ],
            expose_headers=["X-Request-ID", "Retry-After", "Location", "Idempotent-Replayed"],
            max_age=600,
        )
    # Outermost: the request id, the security headers, the dialect's errors and the
    # metrics on every response, 413s and CORS preflights included.
    app.add_middleware(EdgeMiddleware)
    return app
