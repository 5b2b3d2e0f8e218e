"""A worker's own HTTP port: ``/metrics`` (Prometheus), ``/healthz`` and ``/readyz``.

``/healthz`` answers 200 while the process serves it; ``/readyz`` answers 200
only while ``ready()`` is true (a GPU worker: reading its streams; not yet
loaded, or stopping: 503). Served from a daemon thread, so it never holds up
the process it reports on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from core.ops.metrics import token_matches

log = logging.getLogger(__name__)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # an idle or trickling client gives up its thread

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would drown the worker's log."""


def health_app(
    ready: Callable[[], bool], token: str | None = None
) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _text(start_response, "200 OK", "ok")
        if path == "/readyz":
            if ready():
                return _text(start_response, "200 OK", "ready")
            return _text(start_response, "503 Service Unavailable", "not ready")
        if path == "/metrics":
            if not token_matches(token, environ.get("HTTP_AUTHORIZATION")):
                return _text(start_response, "401 Unauthorized", "metrics token required")
            return metrics(environ, start_response)
        return _text(start_response, "404 Not Found", "not found")

    return app


def _text(start_response: Callable[..., Any], status: str, body: str) -> list[bytes]:
    data = (body + "\n").encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    )
    return [data]


def serve(
    host: str, port: int, ready: Callable[[], bool], token: str | None = None
) -> WSGIServer | None:
    """Serve the port from a daemon thread; None (logged) if it cannot be bound."""
    try:
        server = make_server(
            host, port, health_app(ready, token), server_class=_Server, handler_class=_QuietHandler
        )
    except OSError as exc:
        # Metrics are not worth failing the worker for; the log says why.
        log.error("metrics and health not served", extra={"port": port, "error": str(exc)})
        return None
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
