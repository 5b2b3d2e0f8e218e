"""Typed dependencies: settings, database session, Redis, the calling key.

Every dependency that does no blocking I/O is ``async def``: FastAPI runs a
plain ``def`` dependency in the thread pool, a hop per dependency per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Annotated

import redis
from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session, sessionmaker

from api.completions import CompletionHub
from api.errors import ApiError
from api.jobs.reads import GroupRead
from api.keycache import KeyCache
from api.limits import RequestLimits
from api.state import ApiSettings, AppState, app_state
from core.db.keys import verify_token
from core.db.schema import ApiKey
from core.models.catalog import ModelSpec


async def get_settings_dep(request: Request) -> ApiSettings:
    return app_state(request).settings


def get_session(request: Request) -> Iterator[Session]:
    sessions: sessionmaker[Session] = app_state(request).sessions
    with sessions() as session:
        yield session


async def get_redis(request: Request) -> redis.Redis:
    client: redis.Redis = app_state(request).redis
    return client


async def get_catalog(request: Request) -> dict[str, ModelSpec]:
    catalog: dict[str, ModelSpec] = app_state(request).catalog
    return catalog


async def get_group_read(request: Request) -> GroupRead:
    reads: GroupRead = app_state(request).group_read
    return reads


async def get_hub(request: Request) -> CompletionHub:
    hub: CompletionHub = app_state(request).hub
    return hub


SettingsDep = Annotated[ApiSettings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
CatalogDep = Annotated[dict[str, ModelSpec], Depends(get_catalog)]
HubDep = Annotated[CompletionHub, Depends(get_hub)]
GroupReadDep = Annotated[GroupRead, Depends(get_group_read)]


async def get_kick(request: Request) -> Callable[[Sequence[str]], None]:
    kick: Callable[[Sequence[str]], None] = app_state(request).kick
    return kick


async def get_check_callback(request: Request) -> Callable[[str], None]:
    check: Callable[[str], None] = app_state(request).check_callback
    return check


KickDep = Annotated[Callable[[Sequence[str]], None], Depends(get_kick)]
CheckCallbackDep = Annotated[Callable[[str], None], Depends(get_check_callback)]


async def current_key(request: Request) -> ApiKey:
    """The calling key: from this process's cache, else checked in a short session of its own.

    Not the request's session: a long-poll must not hold a pooled connection
    for its whole wait.
    """
    address = request.client.host if request.client else "unknown"
    return await authenticate(app_state(request), request.headers.get("authorization", ""), address)


async def authenticate(state: AppState, header: str, address: str) -> ApiKey:
    """The key an ``Authorization`` value (``Bearer <key>``) names, for a caller at
    ``address``: 401 if none, 429 over its limits (HTTP and gRPC alike)."""
    scheme, _, token = header.partition(" ")
    if not header:
        raise _unauthorized("missing Authorization header (expected: Bearer <api key>)")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("Authorization header must be: Bearer <api key>")
    token = token.strip()
    limits: RequestLimits = state.limits
    cache: KeyCache = state.keys
    key = cache.get(token)
    if key is None:
        # Guessing keys costs a database lookup each: an address that keeps
        # failing is refused before the lookup.
        await limits.refuse_if_failing(address)
        key = await cache.looked_up(token, lambda: run_in_threadpool(_lookup, state.reads, token))
        if key is None:
            await limits.failed(address)
            raise _unauthorized("invalid or revoked API key")
        cache.put(token, key)
    await limits.check(key.id)
    return key


def _lookup(sessions: sessionmaker[Session], token: str) -> ApiKey | None:
    with sessions() as session:
        key = verify_token(session, token)
        if key is not None:
            session.expunge(key)
        return key


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


KeyDep = Annotated[ApiKey, Depends(current_key)]


async def admin_key(key: KeyDep) -> ApiKey:
    """The calling key, which must have the admin scope (403 otherwise)."""
    if key.scope != "admin":
        raise ApiError(403, "forbidden", "this endpoint needs an API key with the admin scope")
    return key


AdminDep = Annotated[ApiKey, Depends(admin_key)]
