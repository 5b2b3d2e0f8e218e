"""Errors in the dialect of the API a path speaks: OpenAI's, or the inference protocol's.

OpenAI's clients read ``{"error": {"message", "type", "param", "code"}}`` and
expect a 400 where Ferry answers 422; the Open Inference Protocol's (Triton's
and KServe's clients) read ``{"error": "message"}``, also with a 400. Every
error Ferry makes (its handlers, its middleware: authentication, rate
limits, body size) is written in Ferry's shape first; on these paths this
middleware rewrites it, so no error path needs to know which API it serves.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The routes that speak OpenAI's dialect.
OPENAI_PATHS = re.compile(r"^/v1/(embeddings|completions|chat/completions|files|batches)(/|$)")
# The Open Inference Protocol's routes (api.oip.routes).
OIP_PATHS = re.compile(r"^/v2(/|$)")
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# "field: why" — Ferry's messages name the field first; OpenAI calls it param.
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]-]*): ")


def openai_error(status: int, error: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Ferry's error object as OpenAI's, and the status OpenAI would answer with."""
    message = str(error.get("message", ""))
    param = error.get("param")
    if param is None and (found := _PARAM.match(message)):
        param = found.group(1)
    status = 400 if status == 422 else status
    type_ = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = error.get("code") or error.get("type")
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}


def oip_error(status: int, error: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Ferry's error object as the inference protocol's, and its status (400 for 422)."""
    return (400 if status == 422 else status), {"error": str(error.get("message", ""))}


class DialectErrorMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        dialect = openai_error if OPENAI_PATHS.match(path) else None
        if dialect is None and OIP_PATHS.match(path):
            dialect = oip_error
        if dialect is None:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewrite(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is complete
                return
            if start is None:
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            status, content = start["status"], body
            try:
                found = json.loads(body)
                error = found.get("error") if isinstance(found, dict) else None
            except ValueError:
                error = None
            if isinstance(error, dict):
                status, converted = dialect(status, error)
                content = json.dumps(converted).encode()
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(content)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})

        await self.app(scope, receive, rewrite)
