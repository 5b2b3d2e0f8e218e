"""/v1/jobs: submit, read (long-poll), cancel, list."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, TypeAdapter

from api.deps import (
    GroupReadDep,
    KeyDep,
    KickDep,
    SessionDep,
    SettingsDep,
    current_key,
)
from api.errors import ApiError
from api.fastparse import Read, parsed_by, read_request
from api.hotpath import HotRoute
from api.jobs import service as services
from api.jobs.events import KEEP_ALIVE, EventStreamResponse, follow, resume_after, sse
from api.jobs.reads import JobRead, is_terminal, until_terminal
from api.jobs.schemas import (
    MAX_IDEMPOTENCY_KEY,
    CancelRequested,
    DeliveryList,
    DeliveryResource,
    JobCreate,
    JobList,
    JobResource,
    JobStatus,
)
from api.jobs.submissions import GroupCommit, prepare_request
from api.models import service as model_service
from api.owned import is_uuid
from api.schemas import error_responses
from api.state import ApiSettings, app_state
from core.db.schema import ApiKey
from core.ops import tracing
from core.ops.metrics import JOBS_ACCEPTED

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 422, 503))


WAIT_QUERY = Query(
    ge=0,
    description="Seconds to wait for a terminal state (at most FERRY_MAX_WAIT_S).",
)
# The two parameters as declared once: in the endpoints' signatures (the OpenAPI
# document) and in the adapters their fast readings validate with (api.fastparse).
Wait = Annotated[float, WAIT_QUERY]
IdempotencyKey = Annotated[str | None, Header(max_length=MAX_IDEMPOTENCY_KEY)]


async def create_job(
    body: JobCreate,
    request: Request,
    key: KeyDep,
    idempotency_key: IdempotencyKey = None,
    wait: Wait = 0,
) -> Response:
    """Submit a job: 202 once it is durable; with ``wait``, 200 with the finished job
    if it ends within that many seconds (else the same 202: it runs all the same)."""
    # The process's parts straight from the app's state, not as dependencies:
    # each dependency costs every submission its resolution.
    state = app_state(request)
    settings: ApiSettings = state.settings
    _check_wait(wait, settings)
    submission = prepare_request(request, key, body, idempotency_key)
    if body.callback_url:
        # The URL's host is resolved (DNS may block): the request's one thread hop.
        await run_in_threadpool(state.check_callback, body.callback_url)
    commit: GroupCommit = state.group_commit
    with tracing.span("ferry.enqueue", attributes={"ferry.model": submission.spec.name}) as span:
        submitted = await commit.submit(submission)
        if span is not None:
            span.set_attribute("ferry.job_id", submitted.job.id)
    headers = {"Location": f"/v1/jobs/{submitted.job.id}"}
    if submitted.replayed:
        headers["Idempotent-Replayed"] = "true"
    else:
        JOBS_ACCEPTED.labels(submitted.job.model, submitted.job.priority).inc()
        log.info(
            "job accepted",
            extra={
                "job_id": submitted.job.id,
                "request_id": request.state.request_id,
                "model": submitted.job.model,
                "lane": submitted.job.priority,
            },
        )
    resource = services.to_resource(submitted.job, submitted.estimated_wait_ms)
    resource.max_tokens = submitted.max_tokens
    if wait > 0:
        # (A replay of a job that has ended is answered with its outcome at once.)
        found = (
            resource
            if is_terminal(resource)
            else await until_terminal(app_state(request), JobRead(key.id, resource.id), wait)
        )
        if is_terminal(found):
            return _json(found, 200, headers)
    return _json(resource, 202, headers)


WAIT_PARAM = {"wait": (TypeAdapter(Wait), 0.0)}
SUBMIT_HEADERS = {"idempotency-key": (TypeAdapter(IdempotencyKey), None)}


async def submit_job(request: Request) -> Response:
    """Serves ``POST /v1/jobs``: create_job's parameters read as FastAPI would, without
    its per-request dependency solving (api.fastparse)."""
    # Announced before its body is read: a group of submissions gathering meanwhile waits
    # for it (api.groups).
    with app_state(request).group_commit.coming():
        read = await read_request(
            request, current_key, query=WAIT_PARAM, headers=SUBMIT_HEADERS, body=JobCreate
        )
        assert read.body is not None
        return await create_job(
            read.body, request, read.key, read.headers["idempotency-key"], read.query["wait"]
        )


router.add_api_route(
    "",
    create_job,
    methods=["POST"],
    status_code=202,
    response_model=JobResource,
    responses={
        200: {"model": JobResource, "description": "Finished within `wait` seconds."},
        **error_responses(400, 409, 413, 415, 429),
    },
    route_class_override=parsed_by(submit_job),
)


def _check_wait(wait: float, settings: ApiSettings) -> None:
    if wait > settings.max_wait_s:
        # The bound travels with the error, so a client can ask again within it.
        raise ApiError(
            422,
            "invalid_request",
            f"wait: at most {settings.max_wait_s:g} seconds",
            max_wait_s=settings.max_wait_s,
        )


def _json(
    resource: JobResource, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """The resource as the response, serialized once (FastAPI would validate it again)."""
    return Response(resource.model_dump_json(), status, headers, "application/json")


async def read_job(
    job_id: str,
    request: Request,
    key: KeyDep,
    reads: GroupReadDep,
    settings: SettingsDep,
    wait: Wait = 0,
) -> Response:
    _check_wait(wait, settings)
    if not is_uuid(job_id):
        raise ApiError(404, "not_found", f"no job {job_id!r}")
    wanted = JobRead(key.id, job_id)
    if wait <= 0:
        return _json(await reads.submit(wanted))
    return _json(await until_terminal(app_state(request), wanted, wait))


async def poll_job(request: Request) -> Response:
    """Serves ``GET /v1/jobs/{job_id}`` (a long-poll per job, the hottest read): read_job's
    parameters read as FastAPI would, without its dependency solving (api.fastparse)."""
    read: Read[ApiKey, BaseModel] = await read_request(request, current_key, query=WAIT_PARAM)
    state = app_state(request)
    return await read_job(
        request.path_params["job_id"],
        request,
        read.key,
        state.group_read,
        state.settings,
        read.query["wait"],
    )


router.add_api_route(
    "/{job_id}",
    read_job,
    methods=["GET"],
    response_model=JobResource,
    responses=error_responses(404),
    route_class_override=parsed_by(poll_job),
)

# Served straight from the app's innermost middleware (api.hotpath): the two requests a
# job's client makes most.
HOT = (HotRoute("POST", "/v1/jobs", submit_job), HotRoute("GET", "/v1/jobs/{job_id}", poll_job))


@router.delete(
    "/{job_id}",
    response_model=JobResource,
    responses={
        202: {
            "model": CancelRequested,
            "description": "A running generation: its worker stops it at its next step.",
        },
        **error_responses(404, 409),
    },
)
async def cancel_job(job_id: str, request: Request, key: KeyDep) -> Response:
    """Cancel a queued job (200, ``cancelled``), or stop a running generation (202, still
    ``running``, ``cancel_requested``: it ends ``cancelled`` with the tokens it made)."""
    state = app_state(request)
    resource, requested = await run_in_threadpool(services.cancel_and_announce, state, key, job_id)
    if requested:
        body = CancelRequested(**resource.model_dump())
        return Response(body.model_dump_json(), 202, None, "application/json")
    return _json(resource)


@router.get(
    "/{job_id}/events",
    status_code=200,
    # The route returns its EventStreamResponse itself; the default class keeps
    # the error statuses documented as JSON, which is what they are.
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "The job's events: status, token (generations), done.",
        },
        **error_responses(401, 404, 422),
    },
)
async def job_events(
    job_id: str,
    request: Request,
    key: KeyDep,
    reads: GroupReadDep,
    last_event_id: Annotated[str | None, Header(max_length=64)] = None,
) -> EventStreamResponse:
    """Server-Sent Events: the job's status now (without an id), then its events from
    the start, or after ``Last-Event-ID``, until ``done``."""
    if not is_uuid(job_id):
        raise ApiError(404, "not_found", f"no job {job_id!r}")
    after = resume_after(last_event_id)
    job = await reads.submit(JobRead(key.id, job_id))
    state = app_state(request)
    generation = model_service.is_generation(state.catalog, job.model)

    async def chunks() -> AsyncIterator[bytes]:
        yield sse("status", {"status": job.status})
        async for seen in follow(state, key.id, job, generation=generation, after=after):
            if seen is None:
                yield KEEP_ALIVE
            else:
                yield sse(seen.event.kind, seen.event.data, seen.id)

    return EventStreamResponse(chunks())


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
