"""uvicorn, with a not-ready phase before it stops.

On the first SIGTERM or SIGINT the app's ``draining`` flag is set: ``/readyz``
answers 503 and long-polls return at once, while the server still serves, so
a load balancer stops sending new requests. After ``not_ready_s`` uvicorn's
own graceful shutdown runs: no new connections, requests in flight finish. A
second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, not_ready_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.not_ready_s = not_ready_s
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.state.draining = True
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
