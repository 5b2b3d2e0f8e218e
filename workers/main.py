"""``ferry worker``: one process, one model, one device."""

from __future__ import annotations

import logging
import signal
import socket
import threading
from types import FrameType

import redis

from core.db import make_engine, make_sessionmaker
from core.settings import Settings
from core.webhooks import DeliveryKicker
from workers.consumer import StreamConsumer
from workers.loop import BatchLoop
from workers.recorder import Recorder
from workers.runtimes import load_runtime
from workers.scheduling import build_state, make_policy

log = logging.getLogger(__name__)


def default_consumer_name(model: str, device: str) -> str:
    # Stable across restarts, so a restarted worker gets back the entries it
    # had read but not acknowledged.
    return f"{socket.gethostname()}:{model}:{device}"


def build_loop(
    settings: Settings, model: str, device: str | None = None, name: str | None = None
) -> BatchLoop:
    settings = settings.for_model(model)
    if not settings.redis_url:
        raise SystemExit("FERRY_REDIS_URL is not set (`ferry up` sets it for its workers)")
    runtime = load_runtime(model, settings, device)
    state = build_state(settings, runtime)
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    consumer = StreamConsumer(
        client,
        settings.key_prefix,
        model,
        name or default_consumer_name(model, runtime.device),
    )
    engine = make_engine(settings.sqlalchemy_url)
    return BatchLoop(
        runtime=runtime,
        consumer=consumer,
        recorder=Recorder(make_sessionmaker(engine)),
        client=client,
        prefix=settings.key_prefix,
        state=state,
        policy=make_policy(settings.scheduler, state, settings.fixed_max_delay_ms / 1000.0),
        prefetch=settings.prefetch,
        max_attempts=settings.max_attempts,
        visibility_timeout_s=settings.visibility_timeout_s,
        drain_s=settings.worker_drain_s,
        kick=DeliveryKicker(settings.redis_url, settings.key_prefix),
    )


def run_worker(
    settings: Settings, model: str, device: str | None = None, name: str | None = None
) -> int:
    loop = build_loop(settings, model, device, name)
    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping after the current batch", extra={"signal": signum})
        loop.request_stop()
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    loop.run(stop)
    return 0
