"""The API in uvicorn on a free port, in a thread of the test's own process.

For tests that drive the API with real HTTP clients (many connections, the
SDK, the ``openai`` package) without a ``ferry up`` of its own: the app is the
real one, on the real Redis and database the settings name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from sqlalchemy import event

from api.app import create_app
from api.jobs.reads import LoopReader
from api.state import app_state
from core.config.settings import Settings
from harness.ports import free_port


class Served:
    """The app of ``settings`` in uvicorn on a free port, in a thread; its engine's
    statements, and its reader's on PostgreSQL, counted."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = app = create_app(settings)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, port=self.port, log_config=None, access_log=False, timeout_graceful_shutdown=10
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.statements: list[str] = []

    def __enter__(self) -> Served:
        self.thread.start()
        until = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < until, "uvicorn did not start"
            time.sleep(0.02)

        state = app_state(self.app)

        @event.listens_for(state.engine, "before_cursor_execute")
        def _count(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
            self.statements.append(statement)

        if isinstance(state.reader, LoopReader):  # PostgreSQL's reads bypass the engine
            state.reader.sent.append(
                lambda statement, _parameters: self.statements.append(statement)
            )
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not stop"

    def count(self, prefix: str) -> int:
        return sum(1 for s in self.statements if s.lstrip().upper().startswith(prefix))


@contextmanager
def served(settings: Settings, **changes: Any) -> Iterator[Served]:
    with Served(settings.model_copy(update=changes)) as running:
        yield running
