"""A GPU worker's answers to Celery's remote-control inspections (Flower's worker page).

Flower fills a worker's page by broadcasting ``inspect`` commands (stats,
active_queues, registered, active, ...) on Celery's pidbox mailbox. A GPU worker
answers them from a thread of its own with what it is: its model, device,
streams, the batch it is running and the batches it has run. Commands that
would change a Celery worker (shutdown, pool resizing, rate limits, ...) do not
apply to it and are answered with an error; ``ferry up`` or the container
runtime stops a GPU worker, with SIGTERM.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from celery import Celery

from core.streams.protocol import stream_key
from scheduler.vocabulary import LANES
from workers.gpu.presence import CeleryPresence, task_name

log = logging.getLogger(__name__)

DRAIN_S = 0.5
RETRY_S = 2.0
INSPECTIONS = (
    "ping",
    "stats",
    "active_queues",
    "registered",
    "active",
    "reserved",
    "scheduled",
    "revoked",
    "conf",
    "report",
    "clock",
)


class Handlers(dict[str, Callable[..., Any]]):
    """Every command name maps to a handler; the ones a GPU worker cannot do answer so."""

    def __missing__(self, method: str) -> Callable[..., Any]:
        def refuse(_state: Any, **_kwargs: Any) -> dict[str, str]:
            return {"error": f"{method!r} does not apply to a Ferry GPU worker"}

        return refuse


@dataclass(eq=False)
class ControlResponder:
    """Answers inspections for one GPU worker (its node name is the presence's)."""

    app: Celery
    presence: CeleryPresence
    prefix: str
    facts: Callable[[], dict[str, Any]]
    conf: dict[str, Any] = field(repr=False)
    started: float = field(init=False, default_factory=time.monotonic)
    _stop: threading.Event = field(init=False, repr=False, default_factory=threading.Event)
    _thread: threading.Thread | None = field(init=False, repr=False, default=None)

    @property
    def hostname(self) -> str:
        return self.presence.hostname

    def handlers(self) -> Handlers:
        handlers = Handlers()
        for name in INSPECTIONS:
            answer = getattr(self, f"_{name}")
            handlers[name] = lambda _state, _answer=answer, **_kwargs: _answer()
        return handlers

    def _ping(self) -> dict[str, str]:
        return {"ok": "pong"}

    def _clock(self) -> dict[str, int]:
        return {"clock": self.app.clock.value}

    def _report(self) -> dict[str, str]:
        return {"ok": f"Ferry GPU worker for {self.presence.model}"}

    def _stats(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        broker = self.app.connection_for_read()
        try:
            info = broker.info()
        finally:
            broker.release()
        return {
            "pid": os.getpid(),
            "clock": str(self.app.clock.value),
            "uptime": round(time.monotonic() - self.started),
            "total": {task_name(self.presence.model): self.presence.processed},
            "pool": {
                "implementation": "ferry batch loop",
                "max-concurrency": 1,
                "processes": [os.getpid()],
            },
            "prefetch_count": self.conf.get("prefetch"),
            # Where it is, never how to log in.
            "broker": {
                key: info.get(key) for key in ("transport", "hostname", "port", "virtual_host")
            },
            "rusage": {
                "utime": usage.ru_utime,
                "stime": usage.ru_stime,
                "maxrss": usage.ru_maxrss,
            },
            **self.facts(),
        }

    def _active_queues(self) -> list[dict[str, Any]]:
        return [
            {
                "name": stream_key(self.prefix, self.presence.model, lane),
                "exchange": {"name": "", "type": "redis stream"},
                "routing_key": lane,
                "durable": True,
                "exclusive": False,
                "auto_delete": False,
                "no_ack": False,
                "alias": None,
                "queue_arguments": None,
                "binding_arguments": None,
            }
            for lane in LANES
        ]

    def _registered(self) -> list[str]:
        return [task_name(self.presence.model)]

    def _active(self) -> list[dict[str, Any]]:
        batch = self.presence.current
        if batch is None:
            return []
        return [
            {
                **batch,
                "hostname": self.hostname,
                "acknowledged": False,
                "worker_pid": os.getpid(),
                "type": batch["name"],
            }
        ]

    def _reserved(self) -> list[Any]:
        return []

    def _scheduled(self) -> list[Any]:
        return []

    def _revoked(self) -> list[Any]:
        return []

    def _conf(self) -> dict[str, Any]:
        return dict(self.conf)

    # The listening thread.

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception as exc:  # the broker went away: listen again once it is back
                log.warning(
                    "celery remote control unavailable; retrying",
                    extra={"model": self.presence.model, "error_type": type(exc).__name__},
                )
                self._stop.wait(RETRY_S)

    def _listen(self) -> None:
        with self.app.connection_for_read() as connection:
            node = self.app.control.mailbox(connection).Node(
                self.hostname, handlers=self.handlers()
            )
            node.channel = connection.channel()
            consumer = node.listen()
            try:
                while not self._stop.is_set():
                    try:
                        connection.drain_events(timeout=DRAIN_S)
                    except TimeoutError:
                        continue
            finally:
                consumer.cancel()


def stop_on_signals(request_stop: Callable[[], None], message: str) -> threading.Event:
    """An event SIGTERM and SIGINT set, after asking the loop to stop (``request_stop``)."""
    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.info(message, extra={"signal": signum})
        request_stop()
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return stop
