"""A hot route's request read without FastAPI's per-request dependency solving.

FastAPI resolves an endpoint's parameters anew for every request (its
dependency tree, each query, header and body field through its own
machinery): for a submission that is about a third of the event loop's CPU
(measured with cProfile on the API's thread under bench/capacity.py). A route
made with :func:`parsed_by` keeps its endpoint's signature for the OpenAPI
document, but is served by a handler that reads the same parameters itself
with pydantic, and fails the same way: the calling key first (its 401 or
429 before any validation, as a dependency's), then a
:class:`~fastapi.exceptions.RequestValidationError` carrying every query,
header and body error with the locations FastAPI gives them, which the app's
handler turns into the same 400, 415 or 422 (``api.errors``).
tests/unit/test_fastparse.py holds the two to the same answers.
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError

Model = TypeVar("Model", bound=BaseModel)
Errors = list[dict[str, Any]]


def parsed_by(handler: Callable[[Request], Awaitable[Response]]) -> type[APIRoute]:
    """An APIRoute class whose requests ``handler`` serves (its endpoint only documents)."""

    class ParsedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            async def app(request: Request) -> Response:
                return await handler(request)

            return app

    return ParsedRoute


def _located(exc: ValidationError, prefix: tuple[str, ...]) -> Errors:
    errors: Errors = []
    for error in exc.errors(include_url=False):
        located = dict(error)
        located["loc"] = (*prefix, *error["loc"])
        errors.append(located)
    return errors


def _value(
    raw: str | None, loc: tuple[str, str], adapter: TypeAdapter[Any], default: Any
) -> tuple[Any, Errors]:
    if raw is None:
        return default, []
    try:
        return adapter.validate_python(raw), []
    except ValidationError as exc:
        return default, _located(exc, loc)


def query_value(
    request: Request, name: str, adapter: TypeAdapter[Any], default: Any
) -> tuple[Any, Errors]:
    """A query parameter as FastAPI reads one of a scalar type: its last value, or the
    default when absent."""
    return _value(request.query_params.get(name), ("query", name), adapter, default)


def header_value(
    request: Request, name: str, adapter: TypeAdapter[Any], default: Any
) -> tuple[Any, Errors]:
    """A header as FastAPI reads one (its first value), or the default when absent."""
    return _value(request.headers.get(name), ("header", name), adapter, default)


def _is_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


async def json_body(request: Request, model: type[Model]) -> tuple[Model | None, Errors]:
    """The body as FastAPI reads a required JSON body of ``model``: parsed as JSON when its
    Content-Type says JSON, else validated as the bytes it is (and so refused); an empty
    body is missing."""
    raw = await request.body()
    if not raw:
        return None, [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
    value: Any = raw
    content_type = request.headers.get("content-type")
    if content_type and _is_json(content_type):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            error = {
                "type": "json_invalid",
                "loc": ("body", exc.pos),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": exc.msg},
            }
            return None, [error]
        except Exception as exc:  # not text at all, or nested past the recursion limit
            raise HTTPException(400, "There was an error parsing the body") from exc
    try:
        return model.model_validate(value, from_attributes=True), []
    except ValidationError as exc:
        return None, _located(exc, ("body",))


def raise_if(errors: Errors) -> None:
    if errors:
        raise RequestValidationError(errors)
