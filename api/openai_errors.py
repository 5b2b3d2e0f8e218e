"""Errors in the dialect of the API a path speaks: OpenAI's, or the inference protocol's.

OpenAI's clients read ``{"error": {"message", "type", "param", "code"}}`` and
expect a 400 where Ferry answers 422; the Open Inference Protocol's (Triton's
and KServe's clients) read ``{"error": "message"}``, also with a 400. Every
error Ferry makes (its handlers, its middleware: authentication, rate
limits, body size) is written in Ferry's shape first; on these paths the API's
edge (``api.middleware.EdgeMiddleware``) rewrites it, so no error path needs to know
which API it serves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

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


Dialect = Callable[[int, dict[str, Any]], tuple[int, dict[str, Any]]]


def dialect_for(path: str) -> Dialect | None:
    """How errors are written on ``path``: OpenAI's, the inference protocol's, or Ferry's
    own (None)."""
    if OPENAI_PATHS.match(path):
        return openai_error
    if OIP_PATHS.match(path):
        return oip_error
    return None


def in_dialect(dialect: Dialect, status: int, body: bytes) -> tuple[int, bytes]:
    """An error response's status and body as ``dialect`` writes them; a body that is not
    Ferry's error object is kept as it is."""
    try:
        found = json.loads(body)
        error = found.get("error") if isinstance(found, dict) else None
    except ValueError:
        error = None
    if not isinstance(error, dict):
        return status, body
    status, converted = dialect(status, error)
    return status, json.dumps(converted).encode()
