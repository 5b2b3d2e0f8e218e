"""The hottest routes served without the walk through the app's routers.

Between the last middleware and a route's handler, FastAPI's request passes about a
dozen layers: the exception middleware and its wrapper, the dependencies' exit stack,
the router, each included router's effective routes and their contexts, the route,
and the request-response wrapper with two exit stacks of its own. For a route whose
handler reads its own parameters (``api.fastparse``) none of them does any work, and
together they cost a submission and a job's read about a sixth of the API's CPU.
:class:`HotRoutes`, the innermost of the app's middlewares, sends the requests of
the routes it is given straight to their handlers, through the same exception
handlers as the rest of the app (a Starlette ``ExceptionMiddleware`` of its own,
built from the app's handlers), with the scope a route's handler sees after the
router (``route``, ``endpoint``, ``path_params``). Everything outside it (the edge,
the body limit, CORS) is unchanged; every other request goes on to the router.

A route is taken only where the app's router would pick it: when the middleware is
built, no route the router tries before it may match its paths with its method (or
have a path it matches); if one does, building the app fails, rather than a request
reaching another handler than the router's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


@dataclass(frozen=True)
class HotRoute:
    """One route served by :class:`HotRoutes`: its method, its path template (as the app
    declares it, prefix included) and the handler that serves it."""

    method: str
    path: str
    handler: Handler


@dataclass(frozen=True)
class _Served:
    route: APIRoute
    pattern: re.Pattern[str]
    app: ASGIApp  # the handler behind the app's exception handlers


class HotRoutes:
    """ASGI middleware: the requests of ``routes`` straight to their handlers."""

    def __init__(self, app: ASGIApp, owner: FastAPI, routes: Sequence[HotRoute]) -> None:
        self.app = app
        # The app's exception handlers, as its own ExceptionMiddleware takes them (the
        # 500 is the outer ServerErrorMiddleware's, as for every route).
        handlers = {
            key: value
            for key, value in owner.exception_handlers.items()
            if key not in (500, Exception)
        }
        self._served: dict[str, list[_Served]] = {}
        for hot in routes:
            route = _served_route(owner.router.routes, hot.method, hot.path)
            handled = ExceptionMiddleware(_responder(hot.handler), handlers, owner.debug)
            self._served.setdefault(hot.method, []).append(
                _Served(route, route.path_regex, handled)
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for served in self._served.get(scope["method"], ()):
                found = served.pattern.match(scope["path"])
                if found is None:
                    continue
                route = served.route
                scope["route"] = route
                scope["endpoint"] = route.endpoint
                scope["path_params"] = {
                    name: route.param_convertors[name].convert(value)
                    for name, value in found.groupdict().items()
                }
                await served.app(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _responder(handler: Handler) -> ASGIApp:
    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)

    return respond


def _flat(routes: Sequence[BaseRoute]) -> list[BaseRoute]:
    """The routes in the order the app's router tries them, included routers' in place."""
    flat: list[BaseRoute] = []
    for route in routes:
        original = getattr(route, "original_router", None)
        flat += [route] if original is None else _flat(original.routes)
    return flat


def _served_route(routes: Sequence[BaseRoute], method: str, path: str) -> APIRoute:
    """The APIRoute declared for ``method`` and ``path`` (prefix included), checked to be
    the one the app's router picks for every path it matches: no route tried before it
    takes a path of its (or its of theirs) with that method."""
    ordered = _flat(routes)
    number, route = next(
        (
            (number, route)
            for number, route in enumerate(ordered)
            if isinstance(route, APIRoute)
            and route.path == path
            and method in (route.methods or ())
        ),
        (-1, None),
    )
    if route is None:
        raise LookupError(f"no route {method} {path}")
    sample = _sample(route.path)
    for before in ordered[:number]:
        methods = getattr(before, "methods", None)
        regex = getattr(before, "path_regex", None)
        if methods is not None and method not in methods:
            continue
        if (
            regex is None
            or regex.match(sample)
            or route.path_regex.match(_sample(getattr(before, "path", "")))
        ):
            raise ValueError(f"{method} {path}: {before!r}, tried before it, may take its paths")
    return route


def _sample(template: str) -> str:
    """A path of the template, each parameter given a value."""
    return re.sub(r"{[^}]*}", "x", template)
