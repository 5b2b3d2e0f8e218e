"""/v1/jobs: submit, read (long-poll), cancel, list."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from api import services
from api.deps import (
    CatalogDep,
    CheckCallbackDep,
    HubDep,
    KeyDep,
    KickDep,
    RedisDep,
    SessionDep,
    SettingsDep,
)
from api.errors import ApiError
from api.schemas import (
    DeliveryList,
    DeliveryResource,
    JobCreate,
    JobList,
    JobResource,
    JobStatus,
    error_responses,
)
from core.metrics import JOBS_ACCEPTED, JOBS_FINISHED

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 422, 503))

# A waiting request re-reads the row this often even without a wake-up.
RECHECK_S = 1.0


@router.post(
    "",
    status_code=202,
    response_model=JobResource,
    responses=error_responses(400, 409, 413, 415, 429),
)
def create_job(
    body: JobCreate,
    request: Request,
    response: Response,
    key: KeyDep,
    session: SessionDep,
    client: RedisDep,
    catalog: CatalogDep,
    settings: SettingsDep,
    check_callback: CheckCallbackDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobResource:
    submitted = services.submit_job(
        session,
        client,
        settings.key_prefix,
        catalog,
        key,
        body,
        idempotency_key,
        request.state.request_id,
        requeue_within_s=settings.reconcile_grace_s + settings.reconcile_interval_s,
        check_callback=check_callback,
        max_outstanding=settings.max_outstanding_jobs,
        max_metadata_bytes=settings.max_metadata_bytes,
        max_json_depth=settings.max_json_depth,
        live=request.app.state.versions,
    )
    response.headers["Location"] = f"/v1/jobs/{submitted.job.id}"
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    else:
        JOBS_ACCEPTED.labels(submitted.job.model, submitted.job.priority).inc()
        log.info(
            "job accepted",
            extra={"job_id": submitted.job.id, "request_id": request.state.request_id,
                   "model": submitted.job.model, "lane": submitted.job.priority},
        )  # fmt: skip
    return services.to_resource(submitted.job, submitted.estimated_wait_ms)


@router.get("/{job_id}", response_model=JobResource, responses=error_responses(404))
async def read_job(
    job_id: str,
    request: Request,
    key: KeyDep,
    hub: HubDep,
    settings: SettingsDep,
    wait: Annotated[float, Query(ge=0, description="Seconds to wait for a terminal state.")] = 0,
) -> JobResource:
    if wait > settings.max_wait_s:
        raise ApiError(422, "invalid_request", f"wait: at most {settings.max_wait_s:g} seconds")
    sessions = request.app.state.sessions

    def load() -> services.Job:
        with sessions() as session:
            return services.get_job(session, key, job_id)

    def render(job: services.Job) -> JobResource:
        with sessions() as session:
            return services.to_resource(
                job, None, services.deliveries_of(session, [job]).get(job.id)
            )

    job = await run_in_threadpool(load)
    if wait <= 0 or services.is_terminal(job):
        return await run_in_threadpool(render, job)
    loop = asyncio.get_running_loop()
    until = loop.time() + wait
    with hub.watch(job_id) as woken:
        while not services.is_terminal(job):
            remaining = until - loop.time()
            if remaining <= 0 or getattr(request.app.state, "draining", False):
                break  # timed out, or the API is stopping: answer with the state now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), timeout=min(remaining, RECHECK_S))
            woken.clear()
            job = await run_in_threadpool(load)
    return await run_in_threadpool(render, job)


@router.delete("/{job_id}", response_model=JobResource, responses=error_responses(404, 409))
def cancel_job(job_id: str, key: KeyDep, session: SessionDep, kick: KickDep) -> JobResource:
    job = services.cancel_job(session, key, job_id, kick)
    JOBS_FINISHED.labels(job.model, job.priority, "cancelled").inc()
    return services.render_job(session, job)


@router.get("", response_model=JobList)
def list_jobs(
    key: KeyDep,
    session: SessionDep,
    status: JobStatus | None = None,
    model: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    backfill_id: Annotated[
        str | None, Query(max_length=36, description="List this backfill's items instead.")
    ] = None,
) -> JobList:
    jobs, next_cursor = services.list_jobs(session, key, status, model, limit, cursor, backfill_id)
    deliveries = services.deliveries_of(session, jobs)
    return JobList(
        data=[services.to_resource(job, None, deliveries.get(job.id)) for job in jobs],
        next_cursor=next_cursor,
    )


@router.get("/{job_id}/deliveries", response_model=DeliveryList, responses=error_responses(404))
def list_deliveries(job_id: str, key: KeyDep, session: SessionDep) -> DeliveryList:
    """The job's webhook deliveries, each with every attempt made."""
    return DeliveryList(data=services.job_deliveries(session, key, job_id))


@router.post(
    "/{job_id}/deliveries/redeliver",
    status_code=202,
    response_model=DeliveryResource,
    responses=error_responses(404, 409),
)
def redeliver(job_id: str, key: KeyDep, session: SessionDep, kick: KickDep) -> DeliveryResource:
    """Send the job's webhook again (same webhook-id), from the start of the retry schedule."""
    delivery_id = services.redeliver(session, key, job_id, kick)
    (delivery,) = [d for d in services.job_deliveries(session, key, job_id) if d.id == delivery_id]
    return delivery
