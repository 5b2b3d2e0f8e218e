"""The error format of docs/architecture.md §10: ``{"error": {"type", "message"}}``."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisClusterException
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_STATUS_TYPES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "rate_limited",
    503: "unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers or {}
        self.extra = extra


def error_response(
    status: int,
    type_: str,
    message: str,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": type_, "message": message, **extra}}, status_code=status, headers=headers
    )


def _location(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or "body"


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str]:
    errors = exc.errors()
    for error in errors:
        if error.get("type") == "json_invalid":
            return 400, "invalid_json", f"request body is not valid JSON: {error.get('msg', '')}"
    return 422, "invalid_request", validation_text(errors)


def validation_text(errors: Sequence[Any]) -> str:
    """Pydantic's errors as Ferry says them: "field: why", the first five, ``;``-joined."""
    parts = []
    for error in errors[:5]:
        # Pydantic prefixes a validator's own message with "Value error, ".
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if error.get("type") == "missing":
            message = "is required"
        elif error.get("type") == "extra_forbidden":
            message = "is not a known field"
        parts.append(f"{_location(error.get('loc', ()))}: {message}")
    return "; ".join(parts) or "invalid request"


def _unavailable(request: Request, what: str, exc: BaseException) -> JSONResponse:
    log.warning(
        "dependency unavailable",
        extra={
            "request_id": getattr(request.state, "request_id", None),
            "dependency": what,
            "error_type": type(exc).__name__,
        },
    )
    return error_response(
        503, "unavailable", f"{what} is unavailable; retry shortly", {"Retry-After": "2"}
    )


def _json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method the API documents for this path (its OpenAPI paths, templates matched)."""
    methods: set[str] = set()
    for template, operations in app.openapi()["paths"].items():
        parts = re.split(r"(\{[^/}]+\})", template)
        pattern = "".join("[^/]+" if part.startswith("{") else re.escape(part) for part in parts)
        if re.fullmatch(pattern, request.url.path):
            methods |= {method.upper() for method in operations}
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.type, exc.message, exc.headers, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        body_refused = any(tuple(e.get("loc", ()))[:1] == ("body",) for e in exc.errors())
        if body_refused and request.method in ("POST", "PUT", "PATCH") and not _json(content_type):
            # A JSON body sent as something else is read as no JSON at all: say why.
            return error_response(
                415,
                "unsupported_media_type",
                f"Content-Type must be application/json (got {content_type or 'none'!r})",
            )
        status, type_, message = _validation_message(exc)
        return error_response(status, type_, message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = _STATUS_TYPES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        headers = dict(exc.headers or {})
        if exc.status_code == 400 and message == "There was an error parsing the body":
            # What Starlette says of bytes it could not decode or nest (RecursionError).
            message = "request body is not valid JSON (not UTF-8, or nested too deeply)"
        if exc.status_code == 405:
            # Starlette names only the first route on the path; a path can have several.
            # Paths outside the document (/docs) keep what Starlette found.
            allowed = _allowed_methods(app, request) or headers.get("Allow", "").split(", ")
            headers["Allow"] = ", ".join(allowed)
            message = f"method {request.method} not allowed here (allowed: {', '.join(allowed)})"
        return error_response(exc.status_code, type_, message, headers)

    @app.exception_handler(redis.RedisError)
    @app.exception_handler(RedisClusterException)  # no node serves the slot
    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        return _unavailable(request, "the queue (Redis)", exc)

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(PoolTimeout)
    async def _database_down(request: Request, exc: Exception) -> JSONResponse:
        return _unavailable(request, "the database", exc)

    @app.exception_handler(DataError)
    async def _data_error(request: Request, exc: DataError) -> JSONResponse:
        # The schemas refuse what they know the database cannot store; this is
        # the net under them, so such input is a 4xx, never a 500.
        log.warning(
            "value refused by the database",
            extra={"request_id": getattr(request.state, "request_id", None)},
        )
        return error_response(
            422,
            "invalid_request",
            "a value in the request cannot be stored (check for NUL "
            "characters and non-finite numbers)",
        )
