"""ASGI middleware: the API's edge (request ids, the last-resort error, security headers,
errors in a path's dialect, metrics, the request's span), the body size limit."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from opentelemetry.trace import Span, SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response
from api.openai_errors import Dialect, dialect_for, in_dialect
from core.ops import tracing
from core.ops.metrics import HTTP_DURATION, HTTP_REQUESTS

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_id_for(supplied: str) -> str:
    """The client's request id if it is sane (letters, digits, a few marks), else a new one."""
    return supplied if _REQUEST_ID.match(supplied) else uuid.uuid4().hex


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


class EdgeMiddleware:
    """What every request and response passes, in one layer (one call and one wrapped
    ``send`` a request, where five middlewares made five):

    - ``X-Request-ID`` on every response: the client's (if sane) or a new one;
    - an unexpected exception becomes a 500 that says only "internal error" and the
      request id (the log has the rest), so that even that response carries the id;
    - the security headers (:data:`SECURITY_HEADERS`, a strict CSP but on the docs,
      ``Cache-Control: no-store`` unless the route set one);
    - on the OpenAI and inference protocol paths, an error in that API's dialect
      (``api.openai_errors``), the 500 above included;
    - every request counted and timed by route template (not path: ids would explode),
      with the status the client got;
    - with tracing on, a server span per request: it continues the client's
      ``traceparent``, is named by route template, and is current while the route runs,
      so the jobs the request makes carry it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        begun = time.perf_counter()
        supplied = traceparent = b""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                supplied = value
            elif name == b"traceparent":
                traceparent = value
        request_id = request_id_for(supplied.decode("latin-1"))
        scope.setdefault("state", {})["request_id"] = request_id
        path = scope["path"]
        reply = _Reply(send, request_id, dialect_for(path), path.startswith(DOCS_PATHS))
        try:
            if tracing.on():
                await self._traced(scope, receive, reply, traceparent.decode("latin-1"))
            else:
                await self.app(scope, receive, reply.send)
        except Exception:
            log.exception("unhandled error", extra={"request_id": request_id, "path": path})
            if reply.started:
                raise
            response = error_response(
                500, "internal_error", f"internal error (request_id {request_id})"
            )
            await response(scope, receive, reply.send)
        finally:
            template = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"]
            HTTP_REQUESTS.labels(method, template, str(reply.status)).inc()
            HTTP_DURATION.labels(method, template).observe(time.perf_counter() - begun)

    async def _traced(self, scope: Scope, receive: Receive, reply: _Reply, parent: str) -> None:
        method = scope["method"]
        with tracing.span(method, parent=parent or None, kind=SpanKind.SERVER) as span:
            assert span is not None
            reply.span = span
            try:
                await self.app(scope, receive, reply.send)
            finally:
                reply.span = None  # the last-resort 500, if any, comes after the span
                route = getattr(scope.get("route"), "path", None)
                span.update_name(f"{method} {route or 'unmatched'}")
                span.set_attribute("http.request.method", method)
                if route:
                    span.set_attribute("http.route", route)
                span.set_attribute("ferry.request_id", reply.request_id)


class _Reply:
    """A response on its way out through :class:`EdgeMiddleware`: its start given the
    request id and the security headers; on a dialect's path, an error's start held
    until its body is complete, then both rewritten."""

    __slots__ = (
        "_body",
        "_held",
        "_send",
        "dialect",
        "docs",
        "request_id",
        "span",
        "started",
        "status",
    )

    def __init__(self, send: Send, request_id: str, dialect: Dialect | None, docs: bool) -> None:
        self._send = send
        self.request_id = request_id
        self.dialect = dialect
        self.docs = docs
        self.span: Span | None = None
        self.started = False  # the app began its response (sent or held)
        self.status = 500  # what the client got, once sent
        self._held: Message | None = None
        self._body = b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            status = message["status"]
            if self.span is not None:
                self.span.set_attribute("http.response.status_code", status)
            if self.dialect is not None and status >= 400:
                self._held = message
                return
            await self._start(message, status, message.get("headers", []))
            return
        held = self._held
        if held is None:
            await self._send(message)
            return
        self._body += message.get("body", b"")
        if message.get("more_body", False):
            return
        assert self.dialect is not None
        status, content = in_dialect(self.dialect, held["status"], self._body)
        headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(content)).encode()))
        await self._start({"type": "http.response.start", "status": status}, status, headers)
        await self._send({"type": "http.response.body", "body": content})

    async def _start(self, message: Message, status: int, headers: list[Any]) -> None:
        out = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
        out.append((b"x-request-id", self.request_id.encode()))
        present = {name.lower() for name, _ in out}
        extra = [*SECURITY_HEADERS]
        if not self.docs:
            extra.append((b"content-security-policy", STRICT_CSP))
        if b"cache-control" not in present:
            extra.append((b"cache-control", b"no-store"))
        out += [(name, value) for name, value in extra if name not in present]
        message["headers"] = out
        self.status = status
        await self._send(message)


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
