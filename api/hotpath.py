"""The hottest routes served without the walk through the app's routers.

Between the last middleware and a route's handler, FastAPI's request passes about a
dozen layers: the exception middleware and its wrapper, the dependencies' exit stack,
the router, each included router's effective routes and their contexts, the route,
and the request-response wrapper with two exit stacks of its own. For a route whose
handler reads its own parameters (``api.fastparse``) none of them does any work, and
together they cost a job's read about a quarter of the API's CPU, a submission less
(bench/README.md, beside the API benchmark's table, has the side-by-side run).
:class:`HotRoutes`, the innermost of the app's middlewares, sends the requests of
the routes it is given straight to their handlers, through the same exception
handlers as the rest of the app (a Starlette ``ExceptionMiddleware`` of its own,
built from the app's handlers), with the scope a route's handler sees after the
router (``route``, ``endpoint``, ``path_params``). Everything outside it (the edge,
the body limit, CORS) is unchanged; every other request goes on to the router.

A route is taken only where the app's router would pick it: when the middleware is
built, no route the router tries before it (included routers' routes with their
include's prefix) may match a path of its with its method; where one might, building
the app fails, rather than a request reaching another handler than the router's. A
route's body limit (its own, its router's or its include's) is kept, as the router
keeps it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI, Request, Response
from fastapi._body_limit import wrap_app_with_body_limit
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts
from starlette._utils import get_route_path
from starlette.convertors import Convertor
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.routing import Route
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
    route: APIRoute  # what the router puts in the scope: the route as declared
    pattern: re.Pattern[str]  # its path as served (an include's prefix in it)
    convertors: dict[str, Convertor[Any]]
    app: ASGIApp  # the handler, behind its body limit and the app's exception handlers


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
        contexts = list(iter_route_contexts(owner.router.routes))
        self._served: dict[str, list[_Served]] = {}
        for hot in routes:
            context = _served_context(contexts, hot.method, hot.path)
            # As the router runs a route: its body limit (a route's, its router's or its
            # include's, if any) around the handler, the exception handlers around both.
            limited = wrap_app_with_body_limit(
                _responder(hot.handler), getattr(context, "max_body_size", None)
            )
            self._served.setdefault(hot.method, []).append(
                _Served(
                    cast(APIRoute, context.original_route),
                    context.path_regex,
                    context.param_convertors,
                    ExceptionMiddleware(limited, handlers, owner.debug),
                )
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = get_route_path(scope)
            for served in self._served.get(scope["method"], ()):
                found = served.pattern.match(path)
                if found is None:
                    continue
                route = served.route
                scope["route"] = route
                scope["endpoint"] = route.endpoint
                scope["path_params"] = {
                    name: served.convertors[name].convert(value)
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


def _served_context(contexts: Sequence[RouteContext], method: str, path: str) -> RouteContext:
    """The APIRoute's context (its path as served) for ``method`` and ``path``, checked to
    be what the app's router picks for every path it matches: no route tried before it
    may take one with that method."""
    number, context = next(
        (
            (number, context)
            for number, context in enumerate(contexts)
            if isinstance(context.original_route, APIRoute)
            and context.path == path
            and method in (context.methods or ())
        ),
        (-1, None),
    )
    if context is None:
        raise LookupError(f"no route {method} {path}")
    for before in contexts[:number]:
        methods = before.methods
        if methods is not None and method not in methods:
            continue
        if _may_overlap(before, context):
            raise ValueError(f"{method} {path}: {before.path}, tried before it, may take its paths")
    return context


def _may_overlap(one: RouteContext, other: RouteContext) -> bool:
    """Whether a path may match both routes (``other`` a route of the app's). Exact where
    either is a route without parameters (its one path tried against the other's
    pattern); otherwise whenever the literal text before one's first parameter (a
    mount's whole path) begins the other's: a parameter may hold anything, slashes too
    with the ``path`` convertor, as may what follows a mount's path."""
    one_path, other_path = one.path, other.path
    one_regex = getattr(one, "path_regex", None)
    if one_path is None or other_path is None or one_regex is None:
        return True  # not a path route (a host's, say): it may take anything
    if isinstance(one.original_route, Route) and "{" not in one_path:
        return other.path_regex.match(one_path) is not None
    if "{" not in other_path:
        return one_regex.match(other_path) is not None
    one_head, other_head = one_path.split("{", 1)[0], other_path.split("{", 1)[0]
    return one_head.startswith(other_head) or other_head.startswith(one_head)
