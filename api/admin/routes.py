"""Operator endpoints: every tenant's queues and keys. Admin-scoped keys only."""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from api.admin import service as admin_service
from api.deps import AdminDep, CatalogDep, RedisDep, SessionDep, SettingsDep
from api.errors import ApiError
from api.models import service as model_service
from api.schemas import error_responses
from api.state import app_state
from core.db.keys import list_keys, revoke_key
from core.streams.queues import lane_states, live_workers

router = APIRouter(prefix="/v1/admin", tags=["admin"])


class LaneInfo(BaseModel):
    pending: int  # read by a worker, not acknowledged yet
    lag: int  # read by no worker yet


class TenantLoad(BaseModel):
    key_id: str
    name: str
    waiting: int = 0  # backfill items not fed yet
    queued: int = 0
    running: int = 0


class ModelQueues(BaseModel):
    model: str
    workers: int
    lanes: dict[str, LaneInfo]
    tenants: list[TenantLoad]


class QueueOverview(BaseModel):
    data: list[ModelQueues]


class KeyInfo(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # read from an ApiKey row

    id: str
    name: str
    scope: str
    created_at: dt.datetime
    revoked_at: dt.datetime | None
    weight: float  # its share of a generation engine against other keys' (1: equal)


class KeyList(BaseModel):
    data: list[KeyInfo]


class Activation(BaseModel):
    version: int = Field(ge=1, description="The version new jobs of the model run on from now.")


class Activated(BaseModel):
    model: str
    version: int
    previous: int


@router.post(
    "/models/{name}/activate",
    response_model=Activated,
    responses=error_responses(400, 401, 403, 404, 413, 415, 503),
)
def activate_version(
    name: str,
    body: Activation,
    _admin: AdminDep,
    session: SessionDep,
    request: Request,
    catalog: CatalogDep,
) -> Activated:
    """Make a version the active one: every worker loads it, switches, and drops the old.

    Activating an older version is a rollback. A version whose files the
    backend finds a problem with is refused here; one that fails to load in
    a worker leaves the old one serving (GET /v1/models says why).
    """
    _, model = model_service.served_model(catalog, app_state(request).versions, name)
    previous = model_service.activate_version(session, model, body.version)
    return Activated(model=name, version=body.version, previous=previous)


@router.get("/queues", response_model=QueueOverview, responses=error_responses(401, 403, 503))
def queues(
    _admin: AdminDep,
    session: SessionDep,
    client: RedisDep,
    catalog: CatalogDep,
    settings: SettingsDep,
) -> QueueOverview:
    """Per model: live workers, each lane's stream, and what each tenant has outstanding."""
    tenants: dict[str, dict[str, TenantLoad]] = {}
    for model, key_id, name, status, count in admin_service.outstanding_by_tenant(session):
        by_key = tenants.setdefault(model, {})
        load = by_key.setdefault(key_id, TenantLoad(key_id=key_id, name=name))
        if status in ("waiting", "queued", "running"):
            setattr(load, status, int(count))
    data = [
        ModelQueues(
            model=model,
            workers=live_workers(client, settings.key_prefix, model),
            lanes={
                lane: LaneInfo(pending=state.pending, lag=state.lag)
                for lane, state in lane_states(client, settings.key_prefix, model).items()
            },
            tenants=sorted(
                tenants.get(model, {}).values(), key=lambda t: -(t.queued + t.running + t.waiting)
            ),
        )
        for model in catalog
    ]
    return QueueOverview(data=data)


@router.get("/keys", response_model=KeyList, responses=error_responses(401, 403))
def keys(_admin: AdminDep, session: SessionDep) -> KeyList:
    """Every key, without its hash or secrets."""
    return KeyList(data=[KeyInfo.model_validate(key) for key in list_keys(session)])


@router.post(
    "/keys/{key_id}/revoke", response_model=KeyInfo, responses=error_responses(401, 403, 404)
)
async def revoke(key_id: str, request: Request, _admin: AdminDep) -> KeyInfo:
    """Revoke a key now: its next request to this API process is a 401, and to every other
    process within FERRY_KEY_CACHE_S (how long a process keeps a key it has checked)."""
    sessions = app_state(request).sessions

    def revoked() -> KeyInfo | None:
        with sessions() as session:
            key = revoke_key(session, key_id)
            return None if key is None else KeyInfo.model_validate(key)

    info = await run_in_threadpool(revoked)
    if info is None:
        raise ApiError(404, "not_found", f"no API key {key_id!r}")
    # On the event loop, where the cache is used: no thread changes it meanwhile.
    app_state(request).keys.forget(key_id)
    return info
