"""The API's processes: uvicorn, with a not-ready phase before it stops.

With ``FERRY_API_PROCESSES`` above 1, ``ferry api`` starts that many API
processes that share its port (each binds it with ``SO_REUSEPORT``, so the
kernel spreads connections over them), passes its stop signals on, and
gathers their Prometheus metrics in one folder, so that ``/metrics`` of any
of them counts every process's requests.

On the first SIGTERM or SIGINT the app's ``draining`` flag is set: ``/readyz``
answers 503 and long-polls return at once, while the server still serves, so
a load balancer stops sending new requests. After ``not_ready_s`` uvicorn's
own graceful shutdown runs: no new connections, requests in flight finish. A
second signal stops at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from api.state import mark_draining
from core.config.settings import Settings
from core.ops.collector import freeze_start_up
from ferry.children import stop_with_parent

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, not_ready_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.not_ready_s = not_ready_s
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        freeze_start_up()  # core.ops.collector says why

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        mark_draining(self.app)
        if self._draining:
            self.force_exit = True  # a second signal: stop now
            self.should_exit = True
            return
        if self.not_ready_s <= 0:
            self._draining = True
            self._stop(sig, frame)
            return
        self._draining = True
        log.info("shutting down: not ready now, stopping soon", extra={"delay_s": self.not_ready_s})
        timer = threading.Timer(self.not_ready_s, self._stop, args=(sig, frame))
        timer.daemon = True
        timer.start()

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            return  # already stopping (a second signal came first)
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises the signals it caught once it has stopped, so the
            # exit status would say "killed"; a drained, graceful stop exits 0.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()


def serve_api(settings: Settings, host: str, port: int, reuse_port: bool = False) -> None:
    """One API process, until it is stopped (``reuse_port``: beside others on the port)."""
    from api.app import create_app

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.max_wait_s) + 5,
    )
    server = DrainingServer(config, app, settings.api_shutdown_delay_s)
    if not reuse_port:
        server.run()
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    server.run(sockets=[sock])


def run_api_processes(settings: Settings, host: str, port: int) -> int:
    """``settings.api_processes`` API processes on one port; 0 when all stopped cleanly."""
    metrics_dir = tempfile.mkdtemp(prefix="ferry-api-metrics-")
    env = os.environ | {"PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    args = [sys.executable, "-m", "ferry", "api", "--host", host, "--port", str(port)]
    children: list[subprocess.Popen[bytes]] = []
    stopping = threading.Event()

    def _pass_on(signum: int, _frame: FrameType | None) -> None:
        stopping.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    # Before the children exist, so that none misses a stop; they run in
    # sessions of their own, so a terminal's Ctrl-C reaches them once, from here.
    signal.signal(signal.SIGTERM, _pass_on)
    signal.signal(signal.SIGINT, _pass_on)
    try:
        for _ in range(settings.api_processes):
            children.append(
                subprocess.Popen(
                    [*args, "--reuse-port"],
                    env=env,
                    start_new_session=True,
                    preexec_fn=stop_with_parent,
                )
            )
        while any(child.poll() is None for child in children):
            if not stopping.is_set() and any(child.poll() is not None for child in children):
                # One process died on its own: stop the others, so that whoever
                # supervises `ferry api` (ferry up, Kubernetes) starts it again whole.
                log.error("an API process stopped; stopping the others")
                _pass_on(signal.SIGTERM, None)
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    stopped = (0, -signal.SIGTERM, -signal.SIGINT)
    return 0 if all(child.returncode in stopped for child in children) else 1
