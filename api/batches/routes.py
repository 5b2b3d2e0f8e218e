"""OpenAI-compatible Files and Batch APIs over Ferry's backfills.

A team moves an OpenAI Batch workload onto its own GPUs by changing
``base_url``: ``client.files.create(purpose="batch")``, then
``client.batches.create(endpoint="/v1/embeddings")``, polling
``client.batches.retrieve`` and reading ``client.files.content`` of the
output and error files, in OpenAI's shapes (errors too: ``api.openai_errors``).
Underneath, the batch is a backfill: each request a job in the bulk lane,
resumable, counted exactly; ``GET /v1/backfills/{id}`` shows it too.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from api.batches import service as services
from api.deps import KeyDep
from api.errors import ApiError
from api.openai.routes import OPENAI_ERRORS
from api.state import ApiSettings, app_state
from core.db.schema import utcnow

router = APIRouter(tags=["openai"], responses=OPENAI_ERRORS)

# OpenAI's bounds on a file's expires_after.seconds.
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 2_592_000
MAX_FILENAME = 255


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchCreate(BaseModel):
    """OpenAI's batch request."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(description="/v1/embeddings")
    completion_window: str = Field(
        description="'24h' (OpenAI's only window); Ferry takes any whole number of hours up "
        "to 720. Lines that have not run by then are expired."
    )
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = Field(
        None,
        description="Accepted for compatibility: output files are rendered from the batch's "
        "jobs and live as long as they do.",
    )


class BatchError(BaseModel):
    code: str | None
    message: str | None
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int = Field(
        description="Every request that did not succeed: failed, expired, cancelled."
    )


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    usage: BatchUsage | None = Field(description="Once the batch has finished.")
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


FILE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                        "expires_after[seconds]": {"type": "integer"},
                    },
                }
            }
        },
    }
}


@router.post("/v1/files", response_model=FileObject, openapi_extra=FILE_BODY)
async def upload_file(request: Request, key: KeyDep) -> dict[str, Any]:
    """Upload a batch input file (JSONL: one request per line); checked when a batch uses it."""
    settings: ApiSettings = app_state(request).settings
    if "content-length" not in request.headers:
        # The size must be known before the upload is taken: the limit is checked on it
        # before a byte is read (a chunked body could not be refused until spooled).
        raise ApiError(411, "length_required", "file: send the upload with a Content-Length")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except HTTPException as exc:
        # Starlette's parser refuses a malformed multipart body (or too many parts); the
        # client is told which field, as for any other refusal.
        raise ApiError(
            422, "invalid_request", f"file: a multipart/form-data upload ({exc.detail})"
        ) from None
    try:
        purpose = form.get("purpose")
        if purpose != "batch":
            raise ApiError(
                422,
                "invalid_request",
                f"purpose: {purpose!r}; Ferry keeps files for the Batch API: purpose must be batch",
            )
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(422, "invalid_request", "file: missing (a multipart file part)")
        filename = (upload.filename or "upload.jsonl")[:MAX_FILENAME]
        expires_at = _expires_at(
            form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
        )
        stored = await run_in_threadpool(
            services.store_upload,
            app_state(request).sessions,
            key,
            upload.file,
            filename,
            expires_at,
            settings.backfill_max_bytes,
        )
    finally:
        await form.close()
    return services.file_object(app_state(request).sessions, stored)


def _expires_at(anchor: Any, seconds: Any) -> dt.datetime | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(422, "invalid_request", "expires_after.anchor: must be created_at")
    try:
        after = int(str(seconds))
    except ValueError:
        after = 0
    if not MIN_EXPIRY_S <= after <= MAX_EXPIRY_S:
        raise ApiError(
            422,
            "invalid_request",
            f"expires_after.seconds: between {MIN_EXPIRY_S} and {MAX_EXPIRY_S}",
        )
    return utcnow() + dt.timedelta(seconds=after)


@router.get("/v1/files", response_model=FileList)
def list_files(
    request: Request,
    key: KeyDep,
    purpose: Literal["batch", "batch_output"] | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    after: Annotated[str | None, Query(max_length=64)] = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    return services.list_files(
        app_state(request).sessions, key, purpose, limit, after, ascending=order == "asc"
    )


@router.get("/v1/files/{file_id}", response_model=FileObject)
def read_file(file_id: str, request: Request, key: KeyDep) -> dict[str, Any]:
    sessions = app_state(request).sessions
    return services.file_object(sessions, services.stored_file(sessions, key, file_id))


@router.get(
    "/v1/files/{file_id}/content",
    responses={
        200: {"description": "The file's bytes (JSONL).", "content": {"application/jsonl": {}}}
    },
)
def read_file_content(file_id: str, request: Request, key: KeyDep) -> StreamingResponse:
    sessions = app_state(request).sessions
    stored = services.stored_file(sessions, key, file_id)
    return StreamingResponse(
        services.file_content(sessions, stored), media_type="application/jsonl"
    )


@router.delete("/v1/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, request: Request, key: KeyDep) -> dict[str, Any]:
    return services.delete_file(app_state(request).sessions, key, file_id)


@router.post("/v1/batches", response_model=BatchObject)
def create_batch(body: BatchCreate, request: Request, key: KeyDep) -> dict[str, Any]:
    """Run a batch input file as a backfill.

    The file is checked as the batch is made: the answer is the batch in
    progress, or failed with its ``errors`` (each with its line, field and why).
    """
    state = app_state(request)
    batch_id = services.create_batch(
        state.sessions, key, body, state.catalog, state.versions, state.settings
    )
    return services.batch_object(state.sessions, key, batch_id)


@router.get("/v1/batches", response_model=BatchList)
def list_batches(
    request: Request,
    key: KeyDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    return services.list_batches(app_state(request).sessions, key, limit, after)


@router.get("/v1/batches/{batch_id}", response_model=BatchObject)
def read_batch(batch_id: str, request: Request, key: KeyDep) -> dict[str, Any]:
    return services.batch_object(app_state(request).sessions, key, batch_id)


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject)
def cancel_batch(batch_id: str, request: Request, key: KeyDep) -> dict[str, Any]:
    """Stop the batch: requests not started are cancelled (in the error file), running ones
    finish."""
    return services.cancel_batch(app_state(request).sessions, key, batch_id)
