"""/v2: the Open Inference Protocol's REST routes (KServe v2, as Triton serves them).

A Triton or KServe v2 client points at Ferry unchanged: health, server and
model metadata, model readiness, and infer. An infer request's rows become
Ferry jobs (durable, in a lane, with a deadline, batched with all other
traffic); the answer comes when they have ended. The tensors' mapping is
``api.oip.protocol``'s. Errors are the protocol's ``{"error": "..."}`` (written by
``api.middleware.EdgeMiddleware`` from Ferry's own).

The model repository extension (admin keys only) lists every model version
and its state; load and unload are Ferry's activation: unload makes a model
take no new jobs, load makes it take them again, on the version
``parameters.version`` activates if it names one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from importlib import metadata
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from fastapi.types import DecoratedCallable
from pydantic import BaseModel

from api.deps import AdminDep, KeyDep, RedisDep
from api.errors import ApiError
from api.jobs.reads import JobRead, succeeded_output, until_terminal
from api.jobs.submissions import GroupCommit, Submitted, job_create, prepare_in
from api.models import service as model_service
from api.models.routes import readyz
from api.oip import protocol as oip
from api.state import ApiSettings, app_state
from core.db.schema import ApiKey
from core.db.versions import load, unload, version_states
from core.models.catalog import ModelSpec
from core.models.repository import ModelConfig
from core.ops.metrics import JOBS_ACCEPTED
from scheduler.vocabulary import Lane

log = logging.getLogger(__name__)
Parsed = TypeVar("Parsed")


class ProtocolErrorBody(BaseModel):
    """The protocol's error: a message, nothing else."""

    error: str


_MEANINGS = {
    400: "A request the protocol or the model refuses (which tensor, and why); for a model "
    "ready request, the model is not ready.",
    401: "Missing or wrong API key.",
    403: "The key lacks the admin scope.",
    404: "No such model.",
    413: "Request body too large.",
    429: "Over the key's rate or outstanding jobs (see Retry-After).",
    500: "A row's job failed.",
    503: "Redis or the database is unavailable (see Retry-After).",
    504: "A row's job was still running when the wait ran out; it completes all the same.",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ProtocolErrorBody, "description": _MEANINGS[s]} for s in statuses}


_TENSOR = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string", "enum": sorted(oip.DATATYPES)},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "parameters": {"type": "object"},
        "data": {"type": "array", "description": "Row-major, nested or flat."},
    },
}
INFER_BODY = {
    "required": True,
    "description": "The request as JSON; with the binary tensor data extension, the JSON "
    f"header ({oip.HEADER_LENGTH} bytes of it) followed by the tensors' bytes.",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["inputs"],
                "properties": {
                    "id": {"type": "string"},
                    "parameters": {
                        "type": "object",
                        "description": "priority (1 highest), timeout (µs), "
                        "binary_data_output, async.",
                    },
                    "inputs": {"type": "array", "items": _TENSOR},
                    "outputs": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {
                                "name": {"type": "string"},
                                "parameters": {"type": "object"},
                            },
                        },
                    },
                },
            }
        }
    },
}
INFER_RESPONSES = {
    200: {"description": "The outputs (JSON, or a JSON header and binary tensors)."},
    202: {"description": "With parameters.async: the jobs, read and cancelled by /v1/jobs."},
    **errors(400, 401, 404, 413, 429, 500, 503, 504),
}
INDEX_ENTRY = {
    "type": "object",
    "required": ["name", "state", "reason"],
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "state": {
            "type": "string",
            "enum": [oip.READY, oip.UNAVAILABLE, oip.LOADING, oip.UNLOADING],
        },
        "reason": {"type": "string", "description": "Why it is in that state (empty: READY)."},
    },
}


def optional_body(properties: dict[str, Any]) -> dict[str, Any]:
    """An optional JSON object request body with ``properties``, for the OpenAPI document."""
    return {
        "required": False,
        "description": "May be empty.",
        "content": {"application/json": {"schema": {"type": "object", "properties": properties}}},
    }


def repository_body(parameters: dict[str, Any]) -> dict[str, Any]:
    return optional_body({"parameters": {"type": "object", "properties": parameters}})


INDEX_BODY = optional_body(
    {"ready": {"type": "boolean", "description": "Only the versions ready for inference."}}
)
LOAD_BODY = repository_body(
    {"version": {"type": "integer", "minimum": 1, "description": "The version to activate."}}
)
UNLOAD_BODY = repository_body(
    {"unload_dependents": {"type": "boolean", "description": "Taken; Ferry's models have none."}}
)
REPOSITORY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Each model version (for load and unload: the model's) and its state.",
        "content": {"application/json": {"schema": {"type": "array", "items": INDEX_ENTRY}}},
    },
    **errors(400, 401, 403, 404, 503),
}
router = APIRouter(prefix="/v2", tags=["inference protocol"])

# The protocol's extensions this server implements (GET /v2 lists them).
EXTENSIONS = ["binary_tensor_data", "async", "model_repository"]
try:
    VERSION = metadata.version("ferry")
except metadata.PackageNotFoundError:  # run from a source tree not installed
    VERSION = "0"
VersionPath = Annotated[int, Path(ge=1, description="The model's version (its active one).")]


def _posted(
    path: str, body: dict[str, Any], responses: dict[int | str, dict[str, Any]]
) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """A POST route that reads its body itself (the protocol's JSON, or binary tensors):
    ``body`` describes it in the OpenAPI document."""
    return router.post(path, responses=responses, openapi_extra={"requestBody": body})


@router.get("")
def server_metadata() -> dict[str, Any]:
    return {"name": "ferry", "version": VERSION, "extensions": EXTENSIONS}


@router.get("/health/live")
def live() -> dict[str, bool]:
    return {"live": True}


@router.get(
    "/health/ready",
    responses={503: {"description": "Not ready: the database unreachable, or stopping."}},
)
def ready(request: Request, client: RedisDep) -> JSONResponse:
    """Ready as /readyz says (the database reachable, the API not stopping)."""
    answer = readyz(request, client)
    retry = answer.headers.get("Retry-After")
    return JSONResponse(
        {"ready": answer.status_code == 200},
        answer.status_code,
        {"Retry-After": retry} if retry else None,
    )


@router.get("/models/{model}", responses=errors(400, 401, 404))
def model_metadata(model: str, request: Request, _key: KeyDep) -> dict[str, Any]:
    return metadata_of(request, model, None)


@router.get("/models/{model}/versions/{version}", responses=errors(400, 401, 404))
def model_version_metadata(
    model: str, version: VersionPath, request: Request, _key: KeyDep
) -> dict[str, Any]:
    return metadata_of(request, model, version)


@router.get("/models/{model}/ready", responses=errors(400, 401, 404))
def model_ready(model: str, request: Request, client: RedisDep, _key: KeyDep) -> Response:
    return _ready(request, client, model, None)


@router.get("/models/{model}/versions/{version}/ready", responses=errors(400, 401, 404))
def model_version_ready(
    model: str, version: VersionPath, request: Request, client: RedisDep, _key: KeyDep
) -> Response:
    return _ready(request, client, model, version)


@_posted("/models/{model}/infer", INFER_BODY, INFER_RESPONSES)
async def infer(model: str, request: Request, key: KeyDep) -> Response:
    return await _infer(request, key, model, None)


@_posted("/models/{model}/versions/{version}/infer", INFER_BODY, INFER_RESPONSES)
async def infer_version(
    model: str, version: VersionPath, request: Request, key: KeyDep
) -> Response:
    return await _infer(request, key, model, version)


@_posted("/repository/index", INDEX_BODY, REPOSITORY_RESPONSES)
async def repository_index(request: Request, client: RedisDep, _admin: AdminDep) -> JSONResponse:
    """Every version of every model in the repository, its state, and why (admin keys)."""
    ready = _parsed(oip.parse_index_request, await request.body())
    entries = await run_in_threadpool(index_entries, request, client)
    return JSONResponse([e for e in entries if e["state"] == oip.READY] if ready else entries)


@_posted("/repository/models/{model}/load", LOAD_BODY, REPOSITORY_RESPONSES)
async def repository_load(
    model: str, request: Request, client: RedisDep, _admin: AdminDep
) -> JSONResponse:
    """The model takes jobs again (after an unload), on ``parameters.version`` if it names
    one: activated as ``POST /v1/admin/models/{model}/activate`` does (admin keys)."""
    version = _parsed(oip.parse_load_request, await request.body())
    return JSONResponse(await run_in_threadpool(load_model, request, client, model, version))


@_posted("/repository/models/{model}/unload", UNLOAD_BODY, REPOSITORY_RESPONSES)
async def repository_unload(
    model: str, request: Request, client: RedisDep, _admin: AdminDep
) -> JSONResponse:
    """The model takes no new jobs until loaded; those accepted run as ever (admin keys)."""
    _parsed(oip.parse_unload_request, await request.body())
    return JSONResponse(await run_in_threadpool(unload_model, request, client, model))


def _parsed(parse: Callable[[bytes], Parsed], body: bytes) -> Parsed:
    try:
        return parse(body)
    except oip.ProtocolError as exc:
        raise ApiError(exc.status, "invalid_request", exc.message) from exc


def index_entries(owner: Any, client: Any) -> list[dict[str, str]]:
    catalog: dict[str, ModelSpec] = app_state(owner).catalog
    repository = app_state(owner).versions.models()
    entries = []
    for name in sorted(set(catalog) | set(repository)):
        spec = catalog.get(name)
        if spec is None:
            entries += oip.unserved_entries(name, sorted(repository[name].versions))
        else:
            entries += model_entries(owner, client, spec)
    return entries


def model_entries(owner: Any, client: Any, spec: ModelSpec) -> list[dict[str, str]]:
    live = app_state(owner).versions
    settings: ApiSettings = app_state(owner).settings
    known, active = live.of(spec)
    states = version_states(client, settings.key_prefix, spec.name)
    return oip.repository_entries(spec.name, known, active, states, live.unloaded(spec.name))


def served_model(owner: Any, model: str) -> tuple[ModelSpec, ModelConfig]:
    """The model load and unload act on: 404 if the repository has none of that name, 400
    if the API does not serve it."""
    state = app_state(owner)
    if model not in state.catalog and model in state.versions.models():
        message = f"model {model!r} is in the repository but not served: {oip.UNSERVED}"
        raise ApiError(400, "invalid_request", message)
    return model_service.served_model(state.catalog, state.versions, model)


def load_model(owner: Any, client: Any, model: str, version: int | None) -> list[dict[str, str]]:
    state = app_state(owner)
    spec, config = served_model(owner, model)
    with state.sessions() as session:
        if version is not None:
            # A version it refuses is a 400 here, before the model takes jobs again.
            model_service.activate_version(session, config, version)
        load(session, model)
    state.versions.forget()
    log.info("model loaded", extra={"model": model, "version": version})
    return model_entries(owner, client, spec)


def unload_model(owner: Any, client: Any, model: str) -> list[dict[str, str]]:
    state = app_state(owner)
    spec, _ = served_model(owner, model)
    with state.sessions() as session:
        unload(session, model)
    state.versions.forget()
    log.info("model unloaded", extra={"model": model})
    return model_entries(owner, client, spec)


def model_spec(
    owner: Any, model: str, version: int | None, taking_jobs: bool = False
) -> tuple[ModelSpec, tuple[int, ...], int]:
    """The model, its versions and the one that would serve it; 404 for an unknown model
    (``taking_jobs``: 400 for one an operator unloaded)."""
    spec = resolved(owner, model, version, taking_jobs)
    known, active = app_state(owner).versions.of(spec)
    return spec, known, active


def resolved(owner: Any, model: str, version: int | None, taking_jobs: bool) -> ModelSpec:
    """The model (404 for an unknown one), without reading its versions unless ``version``
    names one: an infer request has no use for them, and reading them re-reads the
    repository and the database's activations every second on the event loop."""
    state = app_state(owner)
    try:
        spec, _ = model_service.resolve_model(
            state.catalog, model, version, state.versions, taking_jobs=taking_jobs
        )
    except model_service.UnknownModel as exc:
        raise ApiError(404, "not_found", exc.message) from exc
    return spec


def metadata_of(owner: Any, model: str, version: int | None) -> dict[str, Any]:
    spec, known, active = model_spec(owner, model, version)
    try:
        return oip.model_metadata(spec, known if version is None else [active])
    except oip.ProtocolError as exc:
        raise ApiError(exc.status, "invalid_request", exc.message) from exc


def _ready(request: Request, client: Any, model: str, version: int | None) -> Response:
    """200 when a live worker serves the model's active version; 400 (the protocol's 4xx
    for false) otherwise, saying why."""
    name, why = not_ready(request, client, model, version)
    if why is not None:
        return JSONResponse({"error": why}, 400)
    return JSONResponse({"name": name, "ready": True})


def not_ready(owner: Any, client: Any, model: str, version: int | None) -> tuple[str, str | None]:
    """The model's name, and why it is not ready (None: a live worker serves its active
    version). ``owner``: a request or the app (blocking: a thread)."""
    spec, _, active = model_spec(owner, model, version)
    if app_state(owner).versions.unloaded(spec.name):
        why = "it is unloaded (it takes no new jobs until an operator loads it)"
        return spec.name, f"model {spec.name!r} is not ready: {why}"
    settings: ApiSettings = app_state(owner).settings
    state = version_states(client, settings.key_prefix, spec.name).get(active)
    if state is not None and state.state == "ready":
        return spec.name, None
    why = "no live worker serves it" if state is None else state.state
    return spec.name, f"model {spec.name!r} version {active} is not ready: {why}"


async def _infer(request: Request, key: Any, model: str, version: int | None) -> Response:
    spec = resolved(request, model, version, taking_jobs=True)
    try:
        parsed = oip.parse_request(await request.body(), request.headers.get(oip.HEADER_LENGTH))
    except oip.ProtocolError as exc:
        raise ApiError(exc.status, "invalid_request", exc.message) from exc
    submitted = await submit_rows(request, key, request.state.request_id, spec, version, parsed)
    if parsed.parameters.get("async") is True:
        return _accepted(spec, parsed, submitted)
    ran_on, outputs = await outputs_of(request, key, spec, submitted)
    body, header_length = oip.encode_response(spec.name, ran_on, parsed, outputs)
    if header_length is None:
        return Response(body, 200, media_type="application/json")
    return Response(
        body,
        200,
        headers={oip.HEADER_LENGTH: str(header_length)},
        media_type="application/octet-stream",
    )


async def submit_rows(
    owner: Any,
    key: ApiKey,
    request_id: str,
    spec: ModelSpec,
    version: int | None,
    parsed: oip.InferRequest,
) -> list[Submitted]:
    """An infer request's rows as jobs, one a row, through the group commit (REST and gRPC
    alike; ``owner``: a request or the app). 400 for a request the model refuses, before
    any job is made."""
    state = app_state(owner)
    settings: ApiSettings = state.settings
    try:
        oip.check_outputs(spec, parsed)  # before any job is made, not after they ran
        rows = oip.rows(spec, parsed.inputs, settings.embeddings_max_inputs)
        lane, deadline_ms = oip.lane_and_deadline(parsed.parameters)
    except oip.ProtocolError as exc:
        raise ApiError(exc.status, "invalid_request", exc.message) from exc
    submissions = []
    for index, row in enumerate(rows):
        try:
            job = job_create(
                model=spec.name,
                version=version,
                input=row,
                priority=lane or Lane.NORMAL,
                deadline_ms=deadline_ms,
                metadata={"protocol": "v2", **({"request_id": parsed.id} if parsed.id else {})},
            )
            submissions.append(prepare_in(state, key, job, None, request_id))
        except ApiError as exc:
            # The input's own check names "input"; say which row.
            if exc.message.startswith("input"):
                raise ApiError(exc.status, exc.type, f"row {index}: {exc.message}") from exc
            raise
    commit: GroupCommit = state.group_commit
    submitted = await commit.submit_all(submissions)
    for done in submitted:
        JOBS_ACCEPTED.labels(done.job.model, done.job.priority).inc()
    return submitted


async def outputs_of(
    owner: Any,
    key: ApiKey,
    spec: ModelSpec,
    submitted: list[Submitted],
    wait_s: float | None = None,
) -> tuple[int | None, list[oip.Tensor]]:
    """The rows' outputs once their jobs have ended, as the model's output tensors, and the
    version that ran them (None when a switch split them between two). Waits at most
    ``wait_s`` (the longest long-poll when None): 504 past it, 500 for a failed row."""
    state = app_state(owner)
    settings: ApiSettings = state.settings
    wait = settings.max_wait_s if wait_s is None else min(wait_s, settings.max_wait_s)
    finished = await asyncio.gather(
        *(until_terminal(state, JobRead(key.id, done.job.id), wait) for done in submitted)
    )
    outputs = [succeeded_output(job, f"row {index}") for index, job in enumerate(finished)]
    ran = {job.model_version for job in finished}
    ran_on = ran.pop() if len(ran) == 1 else None
    try:
        return ran_on, oip.output_tensors(spec, outputs)
    except oip.ProtocolError as exc:
        raise ApiError(exc.status, "invalid_request", exc.message) from exc


def _accepted(spec: ModelSpec, parsed: oip.InferRequest, submitted: list[Submitted]) -> Response:
    """The async extension's answer: the jobs, to be read (and cancelled) by the job API."""
    jobs = [{"id": done.job.id, "location": f"/v1/jobs/{done.job.id}"} for done in submitted]
    body: dict[str, Any] = {"model_name": spec.name, "jobs": jobs}
    if parsed.id is not None:
        body["id"] = parsed.id
    headers = {"Location": jobs[0]["location"]} if len(jobs) == 1 else None
    return JSONResponse(body, 202, headers)
