"""A hot route's request read without FastAPI's per-request dependency solving.

FastAPI resolves an endpoint's parameters anew for every request (its
dependency tree, each query, header and body field through its own
machinery). A route made with :func:`parsed_by` keeps its endpoint's
signature for the OpenAPI document, but is served by a handler that reads
the same parameters itself (:func:`read_request`), in FastAPI's order and
with FastAPI's answers: the body read and decoded first (400 for bytes that
are no JSON), then the calling key (its 401 or 429, as a dependency's), then
a :class:`~fastapi.exceptions.RequestValidationError` carrying every query,
header and body error with the locations FastAPI gives them, which the app's
handler turns into the same 415 or 422 (``api.errors``).
tests/unit/test_fastparse.py holds the two readings to the same answers.
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import HTTPException, Request, Response
from fastapi._body_limit import get_body_limit_error
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY

Model = TypeVar("Model", bound=BaseModel)
Key = TypeVar("Key")
Errors = list[dict[str, Any]]
# A parameter: how it is validated, and its value when the request has none.
Param = tuple[TypeAdapter[Any], Any]


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def parsed_by(handler: Handler) -> type[APIRoute]:
    """An APIRoute class whose requests ``handler`` serves (its endpoint only documents)."""

    class ParsedRoute(APIRoute):
        def get_route_handler(self) -> Handler:
            return handler

    return ParsedRoute


@dataclass(frozen=True)
class Read(Generic[Key, Model]):
    """A request as its endpoint takes it."""

    key: Key
    query: dict[str, Any]
    headers: dict[str, Any]
    body: Model | None


_ABSENT = object()


async def read_request(
    request: Request,
    key: Callable[[Request], Awaitable[Key]],
    *,
    query: Mapping[str, Param] | None = None,
    headers: Mapping[str, Param] | None = None,
    body: type[Model] | None = None,
) -> Read[Key, Model]:
    """The key (``key(request)``), the scalar ``query`` parameters (their last value), the
    ``headers`` (their first) and a required JSON ``body``, read as FastAPI reads an
    endpoint that declares them: the body decoded before the key is asked for, every
    validation error after it, together."""
    raw: Any = await _decoded_body(request) if body is not None else _ABSENT
    found_key = await key(request)
    errors: Errors = []
    values: dict[str, dict[str, Any]] = {"query": {}, "header": {}}
    for where, params, source in (
        ("query", query or {}, request.query_params),
        ("header", headers or {}, request.headers),
    ):
        for name, (adapter, default) in params.items():
            given = source.get(name)
            values[where][name] = default
            if given is None:
                continue
            try:
                values[where][name] = adapter.validate_python(given)
            except ValidationError as exc:
                errors += _located(exc, (where, name))
    model = None
    if body is not None:
        model, body_errors = _validated(raw, body)
        errors += body_errors
    if errors:
        raise RequestValidationError(errors)
    return Read(found_key, values["query"], values["header"], model)


def _located(exc: ValidationError, prefix: tuple[str, ...]) -> Errors:
    errors: Errors = []
    for error in exc.errors(include_url=False):
        located = dict(error)
        located["loc"] = (*prefix, *error["loc"])
        errors.append(located)
    return errors


def _is_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


async def _decoded_body(request: Request) -> Any:
    """The body as FastAPI reads one for a JSON model: decoded when its Content-Type says
    JSON, else the bytes (which the model then refuses); ``_ABSENT`` when empty. Bytes
    that are no JSON are refused here, as FastAPI refuses them before any dependency."""
    try:
        raw = await request.body()
        if not raw:
            return _ABSENT
        content_type = request.headers.get("content-type")
        if content_type and _is_json(content_type):
            return json.loads(raw)
        return raw
    except json.JSONDecodeError as exc:
        error = {
            "type": "json_invalid",
            "loc": ("body", exc.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": exc.msg},
        }
        raise RequestValidationError([error]) from exc
    except HTTPException:
        raise
    except Exception as exc:  # not text, nested past the recursion limit, client gone
        if MAX_BODY_SIZE_SCOPE_KEY in request.scope and (limit := get_body_limit_error(exc)):
            raise limit from exc
        raise HTTPException(400, "There was an error parsing the body") from exc


def _validated(raw: Any, model: type[Model]) -> tuple[Model | None, Errors]:
    if raw is _ABSENT:
        return None, [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
    try:
        return model.model_validate(raw, from_attributes=True), []
    except ValidationError as exc:
        return None, _located(exc, ("body",))
