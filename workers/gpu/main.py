"""``ferry worker``: one process, one model, one device."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from backends.base import DeviceLost, resolve_device
from backends.catalog import load_runtime, repository_for
from backends.torch_runtime import configure_allocator
from core.config.settings import Settings
from core.db.schema import DatabaseSettings, engine_for, make_sessionmaker
from core.db.versions import active_version
from core.db.webhooks import DeliveryKicker
from core.models.repository import ModelConfig
from core.ops import tracing
from core.ops.collector import freeze_start_up
from core.ops.health import serve
from core.streams.broker import celery_for_events
from core.streams.target import RedisSettings, RedisTarget, ServerClock
from workers.gpu.consumer import StreamConsumer
from workers.gpu.control import ControlResponder, stop_on_signals
from workers.gpu.events import KickDeliveries
from workers.gpu.gpu_stats import register_gpu_metrics
from workers.gpu.loop import BatchLoop, LoopConfig
from workers.gpu.presence import CeleryPresence
from workers.gpu.recorder import Recorder
from workers.gpu.scheduling import BatchingSettings, build_batcher
from workers.gpu.tracing import Tracing
from workers.gpu.versions import RESTART_EXIT_CODE, Loaded, VersionManager, signature
from workers.gpu.worker_loop import WorkerLoop, worker_redis

# A worker whose device became unusable (ferry up starts it again).
DEVICE_LOST_EXIT_CODE = 75

log = logging.getLogger(__name__)


def default_consumer_name(model: str, device: str, instance: int | None = None) -> str:
    # Stable across restarts, so a restarted worker gets back the entries it
    # had read but not acknowledged. Workers that each see one GPU (or MIG
    # slice) through CUDA_VISIBLE_DEVICES all call it cuda:0: the slice tells
    # them apart.
    name = f"{socket.gethostname()}:{model}:{device}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and device.startswith("cuda"):
        name = f"{name}@{visible}"
    # Several workers of one model on one device ([instances] count) each have their own.
    return f"{name}#{instance}" if instance is not None else name


def build_loop(
    settings: Settings,
    model: str,
    device: str | None = None,
    name: str | None = None,
    instance: int | None = None,
) -> BatchLoop:
    """A worker's loop for ``model``, its active version loaded.

    ``instance``: which of several workers of the model on one device this is
    (its consumer name must differ from theirs).
    """
    try:
        target = RedisTarget.of(settings.section(RedisSettings))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    base = settings
    config = repository_for(base, only=model).models.get(model)
    if config is None:
        raise SystemExit(f"the model repository ({base.model_repository_path}) has no {model!r}")
    settings = base.for_model(model, config.settings)
    configure_allocator(settings.cuda_alloc_conf)  # before torch first touches CUDA
    engine = engine_for(settings.section(DatabaseSettings))
    sessions = make_sessionmaker(engine)

    def prepare(fresh: ModelConfig, version: int) -> Loaded:
        """``version`` loaded, and its scheduler state built from its own calibration."""
        own = base.for_model(model, fresh.settings)
        runtime = load_runtime(fresh, own, version, device=device)
        return Loaded(version, runtime, build_batcher(own.section(BatchingSettings), runtime))

    # The version new jobs run on: an operator's activation, else model.toml's.
    with sessions() as session:
        version = active_version(session, config)
    unloadable: dict[int, tuple[str, str]] = {}
    try:
        first = prepare(config, version)
    except Exception as exc:
        if version == config.active_version:
            raise
        # The activated version does not load even alone: serve model.toml's, and
        # do not try it again until its files or the activation change.
        why = f"does not load even alone: {(str(exc) or type(exc).__name__).splitlines()[0]}"
        log.error(
            "the active version failed to load; serving model.toml's",
            extra={
                "model": model,
                "version": version,
                "error": why[:500],
                "serving": config.active_version,
            },
        )
        unloadable[version] = (signature(config, version), why[:500])
        first = prepare(config, config.active_version)
    runtime = first.runtime
    client = worker_redis(target)
    consumer = StreamConsumer(
        client,
        settings.key_prefix,
        model,
        name or default_consumer_name(model, runtime.device, instance),
    )
    loop = BatchLoop(
        runtime=runtime,
        consumer=consumer,
        recorder=Recorder(sessions, first.version),
        batcher=first.prepared,
        client=client,
        prefix=settings.key_prefix,
        config=settings.section(LoopConfig),
        observers=[
            KickDeliveries(DeliveryKicker(target, settings.key_prefix)),
            *([Tracing(model)] if tracing.on() else []),
        ],
        clock=ServerClock(client),
    )
    loop.model_settings = dict(config.settings)
    if settings.model_poll_s > 0:
        loop.versions = VersionManager(
            model,
            first,
            lambda: read_model(base, model),
            prepare,
            sessions,
            client,
            settings.key_prefix,
            consumer.consumer,
            poll_s=settings.model_poll_s,
            unloadable=unloadable,
            load_timeout_s=settings.model_load_timeout_s,
        )
    return loop


def read_model(settings: Settings, model: str) -> ModelConfig | None:
    """The model as the repository has it now; None (keep serving) if it cannot be read."""
    try:
        return repository_for(settings, only=model).models.get(model)
    except Exception:  # a repository being edited: the next poll reads it again
        log.warning("the model repository could not be read", extra={"model": model})
        return None


def run_worker(
    settings: Settings,
    model: str,
    device: str | None = None,
    name: str | None = None,
    metrics_port: int | None = None,
    instance: int | None = None,
) -> int:
    config = repository_for(settings, only=model).models.get(model)
    if config is not None and config.input.kind == "generation":
        # Imported here: the generation engine brings torch, which the encoder
        # workers' module must not load before their backend asks for it.
        from workers.gpu.generation_main import run_generation_worker

        resolved = device or settings.for_model(model, config.settings).device
        consumer = name or default_consumer_name(model, resolve_device(resolved), instance)
        return run_generation_worker(settings, model, device, consumer, metrics_port)
    loops: list[WorkerLoop[Any, Any, Any]] = []
    serve_port(settings, metrics_port, loops)
    loop = build_loop(settings, model, device, name, instance)
    loops.append(loop)
    if metrics_port:
        register_gpu_metrics(model, loop.runtime.device)
    return run_to_exit(
        settings,
        loop,
        loop.runtime.device,
        lambda: worker_facts(loop),
        worker_conf(settings.for_model(model, loop.model_settings), loop),
        "stopping after the current batch",
        watch=loop.observers.add,  # each batch is a Celery task in Flower
    )


def serve_port(
    settings: Settings, metrics_port: int | None, loops: list[WorkerLoop[Any, Any, Any]]
) -> None:
    """The worker's port (metrics and health), when it has one. It answers while the model
    loads: /readyz is 503 until the loop (the first of ``loops``, once built) reads its
    streams."""
    if metrics_port:
        serve(
            settings.metrics_host,
            metrics_port,
            lambda: bool(loops) and loops[0].ready.is_set(),
            settings.metrics_bearer,
        )


def run_to_exit(
    settings: Settings,
    loop: WorkerLoop[Any, Any, Any],
    device: str,
    facts: Callable[[], dict[str, Any]],
    conf: dict[str, Any],
    stopping: str,
    watch: Callable[[CeleryPresence], None] | None = None,
) -> int:
    """Run ``loop`` until a stop signal (logging ``stopping``), in Flower's sight when the
    settings say so: a heartbeat, and ``facts`` and ``conf`` in answer to inspections
    (``watch`` hands the presence to the loop to report more). The process's exit code:
    0, the device lost, or a restart for another version (``ferry up`` acts on each)."""
    presence = control = None
    if settings.worker_events:
        app = celery_for_events(RedisTarget.of(settings.section(RedisSettings)))
        presence = CeleryPresence(app, loop.model, loop.consumer.consumer)
        if watch is not None:
            watch(presence)
        presence.start()
        control = ControlResponder(app, presence, settings.key_prefix, facts, conf)
        control.start()
    stop = stop_on_signals(loop.request_stop, stopping)
    loop.stop_event = stop
    freeze_start_up()  # core.ops.collector says why
    try:
        loop.run(stop)
    except DeviceLost as exc:
        # What it held stays unacknowledged (a generation's, with its tokens so far): it
        # runs again, here after the supervisor's restart (a fresh CUDA context) or on
        # another worker.
        log.critical(
            "device lost; the worker exits to be started again",
            extra={"model": loop.model, "device": device, "error": str(exc)},
        )
        return DEVICE_LOST_EXIT_CODE
    finally:
        if control is not None:
            control.stop()
        if presence is not None:
            presence.stop()
    if loop.restart_requested:
        # Drained: `ferry up` starts it again at once, and it loads the active version alone.
        return RESTART_EXIT_CODE
    return 0


def worker_facts(loop: BatchLoop) -> dict[str, Any]:
    """What Flower's worker page shows beside Celery's own figures."""
    stats = loop.stats
    return {
        "model": loop.model,
        "device": loop.runtime.device,
        # Not "consumer": Celery uses that key for its own consumer stats, which Flower reads.
        "stream_consumer": loop.consumer.consumer,
        "ready": loop.ready.is_set(),
        "pending_entries": len(loop.batcher),
        "batches": stats.batches,
        "jobs": stats.jobs,
        "avg_batch_ms": round(stats.avg_batch_ms, 2),
        "avg_batch_size": round(stats.avg_batch_size, 2),
        "efficiency": round(stats.efficiency, 3),
        "window_ms": None if loop.state.window_s is None else round(loop.state.window_s * 1e3, 2),
    }


def worker_conf(settings: Settings, loop: BatchLoop) -> dict[str, Any]:
    """The batching settings in force (no URLs, no secrets)."""
    names = (
        "scheduler",
        "batch_max_size",
        "batch_max_cost",
        "batch_window_min_ms",
        "batch_window_max_ms",
        "latency_target_ms",
        "memory_threshold",
        "bulk_share",
        "max_attempts",
        "visibility_timeout_s",
        "worker_drain_s",
    )
    return {"prefetch": loop.prefetch} | {name: getattr(settings, name) for name in names}
