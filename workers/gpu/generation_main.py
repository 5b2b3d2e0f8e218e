"""``ferry worker`` for a generation model: its runtime, scheduler and loop, built and run."""

from __future__ import annotations

import logging
from typing import Any, cast

import redis

from backends.base import Runtime
from backends.catalog import load_runtime, repository_for
from backends.generation import CausalLMRuntime
from core.config.settings import Settings
from core.db.schema import DatabaseSettings, engine_for, make_sessionmaker
from core.db.versions import active_version
from core.db.webhooks import DeliveryKicker
from core.models.repository import ModelConfig
from core.streams.target import RedisSettings, RedisTarget, ServerClock
from scheduler.generation import GenerationScheduler
from workers.gpu.consumer import StreamConsumer
from workers.gpu.engine import GenerationEngine
from workers.gpu.generation_loop import GenerationConfig, GenerationLoop, GenerationServing
from workers.gpu.generation_signals import GenerationSignals
from workers.gpu.main import read_model, run_to_exit, serve_port
from workers.gpu.recorder import Recorder
from workers.gpu.versions import Loaded, VersionManager
from workers.gpu.worker_loop import WorkerLoop, worker_redis

log = logging.getLogger(__name__)


def load_generation(
    base: Settings, config: ModelConfig, version: int, device: str | None, client: redis.Redis
) -> Loaded:
    """``version`` of a generation model loaded, with its engine, tokenizer and signals.

    ValueError when the version cannot serve generation (another backend, no
    tokenizer): a version activated later then fails to load and never serves.
    """
    own = base.for_model(config.name, config.settings)
    runtime = load_runtime(config, own, version, device=device)
    if not isinstance(runtime, CausalLMRuntime):
        raise ValueError(f"{config.name}: a generation input needs the causal-lm backend")
    tokenizer = config.tokenizer_path(version)
    if tokenizer is None:
        raise ValueError(f"{config.name}: a generation model needs input.tokenizer")
    log.info(
        "generation model loaded",
        extra={
            "model": config.name,
            "version": version,
            "execution": runtime.execution,
            "why": runtime.why,
            "kv_blocks": runtime.limits.kv_blocks,
            "bytes_per_block": runtime.bytes_per_block,
        },
    )
    signals = GenerationSignals(
        client,
        own.key_prefix,
        config.name,
        runtime.limits,
        "step" if runtime.execution == "step" else "generate",
        runtime.why or "",
        runtime.bytes_per_block,
        bool(getattr(runtime.runner, "prefix_caching", False)),
    )
    serving = GenerationServing(
        GenerationEngine(GenerationScheduler(runtime.limits), runtime.runner),
        tokenizer,
        signals,
        runtime.device,
    )
    # The version manager keeps what the loop runs in ``prepared``; a generation model's
    # runtime is not an encoder's (the loop never reads ``runtime`` here).
    return Loaded(version, cast(Runtime, runtime), serving)


def build_generation_loop(
    settings: Settings,
    config: ModelConfig,
    device: str | None,
    consumer_name: str,
) -> GenerationLoop:
    """The loop of a generation model's worker, its active version loaded."""
    target = RedisTarget.of(settings.section(RedisSettings))
    own = settings.for_model(config.name, config.settings)
    sessions = make_sessionmaker(engine_for(own.section(DatabaseSettings)))
    with sessions() as session:
        version = active_version(session, config)
    client = worker_redis(target)
    try:
        first = load_generation(settings, config, version, device, client)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    serving: GenerationServing = first.prepared
    limits = serving.engine.scheduler.limits
    loop = GenerationLoop(
        serving=serving,
        consumer=StreamConsumer(client, own.key_prefix, config.name, consumer_name),
        recorder=Recorder(sessions, version),
        client=client,
        prefix=own.key_prefix,
        config=GenerationConfig(
            prefetch=max(own.prefetch, limits.max_running * 2),
            max_attempts=own.max_attempts,
            visibility_timeout_s=own.visibility_timeout_s,
            events_ttl_s=own.events_ttl_s,
            progress_every_s=own.progress_every_s,
            drain_s=own.worker_drain_s,
            pipeline=own.pipeline,
            checkpoint_every_tokens=own.checkpoint_every_tokens,
            checkpoint_every_ms=own.checkpoint_every_ms,
        ),
        kick=DeliveryKicker(target, own.key_prefix),
        clock=ServerClock(client),
    )
    if own.model_poll_s > 0:
        name = config.name
        loop.versions = VersionManager(
            name,
            first,
            lambda: read_model(settings, name),
            lambda fresh, number: load_generation(settings, fresh, number, device, client),
            sessions,
            client,
            own.key_prefix,
            consumer_name,
            poll_s=own.model_poll_s,
            load_timeout_s=own.model_load_timeout_s,
        )
    return loop


def run_generation_worker(
    settings: Settings,
    model: str,
    device: str | None,
    consumer_name: str,
    metrics_port: int | None,
) -> int:
    config = repository_for(settings, only=model).models[model]
    loops: list[WorkerLoop[Any, Any, Any]] = []
    serve_port(settings, metrics_port, loops)
    loop = build_generation_loop(settings, config, device, consumer_name)
    loops.append(loop)
    # In Flower as the encoder workers are, but its jobs are not sent as tasks: a
    # generation runs many at once, for many steps.
    return run_to_exit(
        settings,
        loop,
        loop.device,
        lambda: generation_facts(loop),
        generation_conf(loop),
        "stopping",
    )


def generation_facts(loop: GenerationLoop) -> dict[str, Any]:
    """What Flower's worker page shows of a generation worker, beside Celery's own figures."""
    return {
        "model": loop.model,
        "device": loop.device,
        # Not "consumer": Celery uses that key for its own consumer stats, which Flower reads.
        "stream_consumer": loop.consumer.consumer,
        "ready": loop.ready.is_set(),
        "steps": loop.steps,
        "tokens": loop.tokens,
        **loop.signals.facts(loop.engine.scheduler),
    }


def generation_conf(loop: GenerationLoop) -> dict[str, Any]:
    """The scheduling limits and loop settings in force (no URLs, no secrets)."""
    limits = loop.engine.scheduler.limits
    return {
        "prefetch": loop.config.prefetch,
        "max_attempts": loop.config.max_attempts,
        "visibility_timeout_s": loop.config.visibility_timeout_s,
        "kv_blocks": limits.kv_blocks,
        "block_size": limits.block_size,
        "max_running": limits.max_running,
        "step_tokens": limits.step_tokens,
        "prefill_chunk_tokens": limits.prefill_chunk_tokens,
    }
