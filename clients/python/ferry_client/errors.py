"""Errors: every answer that is not a success is a :class:`FerryError` carrying the API's
``error.type``; a request that never got an answer is an :class:`APIConnectionError`."""

from __future__ import annotations

from typing import Any


class FerryError(Exception):
    """The base of every error the client raises."""


class APIError(FerryError):
    """The API answered with an error: ``status``, ``type`` (the API's ``error.type``),
    ``message``, and the rest of the error object in ``details``."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        *,
        request_id: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status} {type_}: {message}")
        self.status = status
        self.type = type_
        self.message = message
        self.request_id = request_id
        self.details = details or {}


class BadRequest(APIError):
    """400 or 422: the request itself is wrong (the message names the field and why)."""


class Unauthorized(APIError):
    """401: no key, or a key that is unknown or revoked."""


class NotFound(APIError):
    """404: no such job, backfill or model for this key."""


class Conflict(APIError):
    """409: the job cannot be changed now (for example, cancelling a finished job)."""


class RateLimited(APIError):
    """429, after the retries: the key is over its rate or its outstanding jobs."""


class Unavailable(APIError):
    """503, after the retries: Redis or the database is unavailable, or the API is stopping."""


class APIConnectionError(FerryError):
    """No answer: the connection failed or the request timed out (after the retries)."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequest,
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    422: BadRequest,
    429: RateLimited,
    503: Unavailable,
}


def error_for(status: int, body: Any, request_id: str | None) -> APIError:
    """The exception for an error answer (a body in the API's ``{"error": {...}}`` shape or not)."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        details = {k: v for k, v in error.items() if k not in ("type", "message")}
        type_, message = str(error.get("type", "error")), str(error.get("message", ""))
    else:
        details, type_, message = {}, "error", str(body)[:500]
    cls = _BY_STATUS.get(status, APIError)
    return cls(status, type_, message, request_id=request_id, details=details)
