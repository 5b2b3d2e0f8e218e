"""ASGI middleware: request ids, the last-resort error, the body size limit."""

from __future__ import annotations

import logging
import re
import time
import uuid

from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response
from core.ops import tracing
from core.ops.metrics import HTTP_DURATION, HTTP_REQUESTS

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_id_for(supplied: str) -> str:
    """The client's request id if it is sane (letters, digits, a few marks), else a new one."""
    return supplied if _REQUEST_ID.match(supplied) else uuid.uuid4().hex


class RequestIdMiddleware:
    """Every response carries ``X-Request-ID``: the client's (if sane) or a new one.

    It is also where an unexpected exception becomes a 500 that says only
    "internal error" and the request id (the log has the rest), so that even
    that response carries the id.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        supplied = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = request_id_for(supplied)
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                headers.append((b"x-request-id", request_id.encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception(
                "unhandled error", extra={"request_id": request_id, "path": scope.get("path")}
            )
            if started:
                raise
            response = error_response(
                500, "internal_error", f"internal error (request_id {request_id})"
            )
            await response(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413, whether announced or streamed.

    A body without ``Content-Length`` (chunked) is read here first, up to the
    limit, and handed on only if it fits.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, streamed: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Paths whose route reads the body as a stream and counts it itself
        # (uploads), with their own limit: never buffered here.
        self.streamed = streamed or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        streamed_limit = self.streamed.get(scope["path"])
        if streamed_limit is not None:
            if length is not None and (not length.isdigit() or int(length) > streamed_limit):
                await self._refuse(scope, receive, send, streamed_limit)
                return
            await self.app(scope, receive, send)
            return
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            # The server holds the body to its announced length.
            await self.app(scope, receive, send)
            return
        buffered: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if buffered:
                return buffered.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, limit: int | None = None
    ) -> None:
        response = error_response(
            413,
            "payload_too_large",
            f"request body is larger than {limit or self.max_bytes} bytes",
        )
        await response(scope, receive, send)


class MetricsMiddleware:
    """Counts and times every request by route template (not path: ids would explode)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope["method"]
            HTTP_REQUESTS.labels(method, template, str(status)).inc()
            HTTP_DURATION.labels(method, template).observe(time.perf_counter() - started)


class TracingMiddleware:
    """A server span per request (tracing on): it continues the client's ``traceparent``,
    is named by route template, and is current while the route runs, so the jobs the
    request makes carry it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not tracing.on():
            await self.app(scope, receive, send)
            return
        supplied = dict(scope["headers"]).get(b"traceparent", b"").decode("latin-1") or None
        method = scope["method"]
        with tracing.span(method, parent=supplied, kind=SpanKind.SERVER) as span:
            assert span is not None

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            try:
                await self.app(scope, receive, send_status)
            finally:
                route = getattr(scope.get("route"), "path", None)
                span.update_name(f"{method} {route or 'unmatched'}")
                span.set_attribute("http.request.method", method)
                if route:
                    span.set_attribute("http.route", route)
                request_id = scope.get("state", {}).get("request_id")
                if request_id:
                    span.set_attribute("ferry.request_id", request_id)


# Sent on every response. Responses carry job results and secrets, so nothing
# caches them; nothing frames them; /docs alone may run the Swagger UI's scripts.
SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-resource-policy", b"same-origin"),
)
STRICT_CSP = b"default-src 'none'; frame-ancestors 'none'"
DOCS_PATHS = ("/docs", "/openapi.json")


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        docs = str(scope.get("path", "")).startswith(DOCS_PATHS)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                extra = [*SECURITY_HEADERS]
                if not docs:
                    extra.append((b"content-security-policy", STRICT_CSP))
                if b"cache-control" not in present:
                    extra.append((b"cache-control", b"no-store"))
                headers += [(name, value) for name, value in extra if name not in present]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)
