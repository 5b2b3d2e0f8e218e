"""OpenAI-compatible routes: ``POST /v1/embeddings``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (those two: ``api.openai.completions``).

An application written for OpenAI's embeddings API moves onto Ferry by
changing its ``base_url``: the request and the answer have OpenAI's shapes
(errors too: ``api.openai_errors``) and the API key is the bearer token.
Underneath, each input is a Ferry job like any other: durable, priced in its
model's tokens, in a lane (``X-Ferry-Priority``, else the key's embeddings
lane, else ``normal``), and batched with all other traffic; a request's
inputs are committed together (one group write) and spread over the batches
the scheduler chooses.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from api.deps import KeyDep
from api.errors import ApiError
from api.jobs.reads import JobRead, succeeded_output, until_terminal
from api.jobs.schemas import JobResource
from api.jobs.submissions import GroupCommit, Submission, job_create, prepare_request
from api.models import service as model_service
from api.openai import completions as completions_openai
from api.openai.embeddings import as_vector, cut, dimensions_problem, encoded
from api.openai.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    TextCompletion,
)
from api.state import ApiSettings, app_state
from core.db.schema import ApiKey
from core.ops.metrics import JOBS_ACCEPTED
from scheduler.vocabulary import Lane

router = APIRouter(tags=["openai"])


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] = Field(description="A text, or a list of texts.")
    model: str = Field(min_length=1, max_length=64)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, ...")
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str | None = Field(description="Ferry's error type (model_not_found, timeout, ...).")


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": OpenAIError, "description": meaning}
    for status, meaning in {
        400: "Invalid request; param names the field.",
        401: "Missing or wrong API key.",
        404: "No such model (model_not_found).",
        413: "Request body too large.",
        415: "The body is not sent as application/json.",
        429: "Over the key's rate or outstanding jobs (see Retry-After).",
        500: "An input's job failed.",
        503: "Redis or the database is unavailable (see Retry-After).",
        504: "An input's job was still running when the wait ran out; it completes all the same.",
    }.items()
}


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


@router.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=OPENAI_ERRORS)
async def create_embeddings(
    body: EmbeddingsRequest,
    request: Request,
    key: KeyDep,
    x_ferry_priority: Annotated[
        Lane | None,
        Header(
            description="The lane of the inputs' jobs (default: the key's embeddings lane, "
            "else normal)."
        ),
    ] = None,
) -> EmbeddingsResponse:
    state = app_state(request)
    settings: ApiSettings = state.settings
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise ApiError(422, "invalid_request", "input: must hold at least one text")
    if len(texts) > settings.embeddings_max_inputs:
        raise ApiError(
            422,
            "invalid_request",
            f"input: {len(texts)} texts; at most {settings.embeddings_max_inputs} in one request",
        )
    try:
        spec, _ = model_service.resolve_model(state.catalog, body.model, None, state.versions)
    except model_service.UnknownModel as exc:
        raise ApiError(404, "model_not_found", exc.message) from exc
    embeddings = spec.embeddings
    if embeddings is None:
        raise ApiError(422, "invalid_request", f"model: {spec.name!r} does not produce embeddings")
    dimensions = body.dimensions or embeddings.dimensions
    problem = dimensions_problem(embeddings, spec.name, dimensions)
    if problem:
        raise ApiError(422, "invalid_request", f"dimensions: {problem}")
    lane = x_ferry_priority or Lane(key.embeddings_lane or Lane.NORMAL)
    submissions = [
        _submission(request, key, body, text, index, lane) for index, text in enumerate(texts)
    ]
    commit: GroupCommit = state.group_commit
    submitted = await commit.submit_all(submissions)
    for done in submitted:
        JOBS_ACCEPTED.labels(done.job.model, done.job.priority).inc()
    finished = await asyncio.gather(
        *(
            until_terminal(state, JobRead(key.id, done.job.id), settings.max_wait_s)
            for done in submitted
        )
    )
    data = [
        Embedding(
            index=index,
            embedding=encoded(_vector(job, index, dimensions), body.encoding_format),
        )
        for index, job in enumerate(finished)
    ]
    tokens = sum(s.cost for s in submissions)
    return EmbeddingsResponse(
        data=data, model=spec.name, usage=Usage(prompt_tokens=tokens, total_tokens=tokens)
    )


def _submission(
    request: Request, key: ApiKey, body: EmbeddingsRequest, text: str, index: int, lane: Lane
) -> Submission:
    try:
        job = job_create(
            model=body.model,
            input=text,
            priority=lane,
            metadata={"openai": "embeddings", **({"user": body.user} if body.user else {})},
        )
        return prepare_request(request, key, job, None)
    except ApiError as exc:
        # The input's own check names "input"; OpenAI's clients want which one.
        if exc.message.startswith("input: ") and isinstance(body.input, list):
            raise ApiError(
                exc.status, exc.type, f"input[{index}]: {exc.message.removeprefix('input: ')}"
            ) from exc
        raise


def _vector(job: JobResource, index: int, dimensions: int) -> list[float]:
    """The job's embedding, cut to ``dimensions`` (and normalised again if it was cut)."""
    vector = as_vector(succeeded_output(job, f"input[{index}]"))
    if vector is None:
        raise ApiError(500, "bad_output", f"input[{index}]: the model's output is not a vector")
    return cut(vector, dimensions)


LaneHeader = Annotated[
    Lane | None, Header(description="The job's lane (the body's priority wins; default normal).")
]
IdempotencyHeader = Annotated[str | None, Header(max_length=255)]
STREAMED = {
    "content": {"text/event-stream": {}},
    "description": "With stream: true, OpenAI's chunks as Server-Sent Events, then [DONE].",
}
GENERATION_ERRORS = {
    **OPENAI_ERRORS,
    409: {"model": OpenAIError, "description": "The job was cancelled before it ran."},
}


@router.post(
    "/v1/completions",
    response_model=TextCompletion,
    responses={200: STREAMED, **GENERATION_ERRORS},
)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    key: KeyDep,
    x_ferry_priority: LaneHeader = None,
    idempotency_key: IdempotencyHeader = None,
) -> Response:
    """A prompt (or prompts) continued by a generation model: one durable job a choice
    (``X-Ferry-Job-Id``, ``X-Ferry-Job-Ids``)."""
    given = body.model_dump(exclude_unset=True)
    return await completions_openai.complete(
        request, key, "completions", given, x_ferry_priority, idempotency_key
    )


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={200: STREAMED, **GENERATION_ERRORS},
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    key: KeyDep,
    x_ferry_priority: LaneHeader = None,
    idempotency_key: IdempotencyHeader = None,
) -> Response:
    """The assistant's next message, rendered by the model's chat template: one durable job
    (``X-Ferry-Job-Id``)."""
    given = body.model_dump(exclude_unset=True)
    return await completions_openai.complete(
        request, key, "chat", given, x_ferry_priority, idempotency_key
    )
