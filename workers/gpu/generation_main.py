"""``ferry worker`` for a generation model: its runtime, scheduler and loop, built and run."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from backends.catalog import load_runtime, repository_for
from backends.generation import CausalLMRuntime
from core.db import make_engine, make_sessionmaker
from core.health import serve
from core.redis_target import RedisTarget
from core.repository import ModelConfig
from core.settings import Settings
from core.versions import active_version
from core.webhooks import DeliveryKicker
from scheduler.generation import GenerationScheduler
from workers.gpu.consumer import StreamConsumer
from workers.gpu.engine import GenerationEngine
from workers.gpu.generation_loop import GenerationConfig, GenerationLoop
from workers.gpu.recorder import Recorder

log = logging.getLogger(__name__)


def is_generation(model: ModelConfig) -> bool:
    return model.input.kind == "generation"


def build_generation_loop(
    settings: Settings,
    config: ModelConfig,
    device: str | None,
    consumer_name: str,
) -> GenerationLoop:
    """The loop of a generation model's worker, its active version loaded."""
    target = RedisTarget.of(settings)
    own = settings.for_model(config.name, config.settings)
    sessions = make_sessionmaker(make_engine(own.sqlalchemy_url))
    with sessions() as session:
        version = active_version(session, config)
    runtime = load_runtime(config, own, version, device=device)
    if not isinstance(runtime, CausalLMRuntime):
        raise SystemExit(f"{config.name}: a generation input needs the causal-lm backend")
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
    client = target.client(decode_responses=True)
    tokenizer = config.tokenizer_path(version)
    if tokenizer is None:
        raise SystemExit(f"{config.name}: a generation model needs input.tokenizer")
    kicker = DeliveryKicker(target, own.key_prefix)
    return GenerationLoop(
        engine=GenerationEngine(GenerationScheduler(runtime.limits), runtime.runner),
        tokenizer_path=tokenizer,
        consumer=StreamConsumer(client, own.key_prefix, config.name, consumer_name),
        recorder=Recorder(sessions, version),
        client=client,
        prefix=own.key_prefix,
        device=runtime.device,
        config=GenerationConfig(
            prefetch=max(own.prefetch, runtime.limits.max_running * 2),
            max_attempts=own.max_attempts,
            visibility_timeout_s=own.visibility_timeout_s,
            events_ttl_s=own.events_ttl_s,
            drain_s=own.worker_drain_s,
        ),
        kick=kicker,
    )


def run_generation_worker(
    settings: Settings,
    model: str,
    device: str | None,
    consumer_name: str,
    metrics_port: int | None,
) -> int:
    config = repository_for(settings, only=model).models[model]
    loops: list[GenerationLoop] = []
    if metrics_port:
        serve(
            settings.metrics_host, metrics_port,
            lambda: bool(loops) and loops[0].ready.is_set(), settings.metrics_bearer,
        )  # fmt: skip
    loop = build_generation_loop(settings, config, device, consumer_name)
    loops.append(loop)
    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signum})
        loop.request_stop()
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    loop.run(stop)
    return 0
