"""/v1/jobs: submit, read (long-poll), cancel, list."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from api import services
from api.deps import CatalogDep, HubDep, KeyDep, RedisDep, SessionDep, SettingsDep
from api.errors import ApiError
from api.schemas import JobCreate, JobList, JobResource, JobStatus, error_responses

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 422, 503))

# A waiting request re-reads the row this often even without a wake-up.
RECHECK_S = 1.0


@router.post(
    "", status_code=202, response_model=JobResource, responses=error_responses(400, 409, 413, 429)
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
    )
    response.headers["Location"] = f"/v1/jobs/{submitted.job.id}"
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
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

    job = await run_in_threadpool(load)
    if wait <= 0 or services.is_terminal(job):
        return services.to_resource(job)
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
    return services.to_resource(job)


@router.delete("/{job_id}", response_model=JobResource, responses=error_responses(404, 409))
def cancel_job(job_id: str, key: KeyDep, session: SessionDep) -> JobResource:
    return services.to_resource(services.cancel_job(session, key, job_id))


@router.get("", response_model=JobList)
def list_jobs(
    key: KeyDep,
    session: SessionDep,
    status: JobStatus | None = None,
    model: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> JobList:
    jobs, next_cursor = services.list_jobs(session, key, status, model, limit, cursor)
    return JobList(data=[services.to_resource(job) for job in jobs], next_cursor=next_cursor)
