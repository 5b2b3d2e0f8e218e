"""What ``POST /v1/completions`` and ``POST /v1/chat/completions`` do.

Each request is one Ferry job, submitted with the same admission as
``POST /v1/jobs`` (the group commit: quota, deadline, durable before
anything is answered), then waited for: the finished job as OpenAI's
``text_completion`` or ``chat.completion``, or, with ``stream: true``, its
events stream as OpenAI's chunks (``api.jobs.events``). The job is durable: a
client that disconnects from a stream leaves it running (unless it asked
for ``ferry_cancel_on_disconnect``), and every answer carries the job's id
in ``X-Ferry-Job-Id`` so its result can be read later from ``/v1/jobs``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api.errors import ApiError
from api.jobs import service as services
from api.jobs.events import KEEP_ALIVE, EventStreamResponse, follow
from api.jobs.reads import JobRead, is_terminal, until_terminal
from api.jobs.schemas import JobCreate, JobResource
from api.jobs.submissions import GroupCommit, Submitted, prepare_request
from api.models import service as model_service
from api.openai.generation import (
    Endpoint,
    GenerationRequest,
    ParamError,
    chunk_object,
    completion_object,
    is_generation_output,
    logprobs_object,
    parse_request,
    usage_chunk,
    usage_of,
)
from api.state import app_state
from core.db.schema import ApiKey
from core.ops.metrics import JOBS_ACCEPTED
from scheduler.vocabulary import Lane

if TYPE_CHECKING:
    from api.state import AppState

DONE = b"data: [DONE]\n\n"
# A job cancelled while running answers with what it made, under this reason.
WITH_OUTPUT = ("succeeded", "cancelled")


async def complete(
    request: Request,
    key: ApiKey,
    endpoint: Endpoint,
    body: dict[str, Any],
    lane_header: Lane | None,
    idempotency_key: str | None,
) -> Response:
    """Submit the request's job, then answer with its completion or stream it."""
    state = app_state(request)
    try:
        asked = parse_request(endpoint, body)
    except ParamError as exc:
        raise ApiError(422, "invalid_request", str(exc), param=exc.param) from None
    _check_model(state, body["model"])
    submitted = await _submit(request, key, asked, body["model"], lane_header, idempotency_key)
    job = submitted.job
    headers = {"X-Ferry-Job-Id": job.id, "Location": f"/v1/jobs/{job.id}"}
    resource = services.to_resource(job)
    if asked.stream:
        return _stream(state, key, asked, resource, headers)
    found = await until_terminal(state, JobRead(key.id, job.id), state.settings.max_wait_s)
    return JSONResponse(_finished(asked, found, headers), headers=headers)


def _check_model(state: AppState, model: str) -> None:
    try:
        spec, _ = model_service.resolve_model(state.catalog, model, None, state.versions)
    except model_service.UnknownModel as exc:
        raise ApiError(404, "model_not_found", exc.message, param="model") from exc
    except ApiError as exc:
        raise ApiError(exc.status, exc.type, exc.message, param="model") from exc
    if not model_service.is_generation(state.catalog, spec.name):
        kind = getattr(spec.input, "kind", "other")
        raise ApiError(
            404,
            "model_not_found",
            f"model: {spec.name!r} is not a generation model (it takes {kind} inputs); "
            "only generation models make completions",
            param="model",
        )


async def _submit(
    request: Request,
    key: ApiKey,
    asked: GenerationRequest,
    model: str,
    lane_header: Lane | None,
    idempotency_key: str | None,
) -> Submitted:
    metadata: dict[str, Any] = {
        "openai": "chat.completions" if asked.endpoint == "chat" else "completions"
    }
    if asked.user is not None:
        metadata["user"] = asked.user
    job = JobCreate(
        model=model,
        input=asked.input,
        priority=Lane(asked.priority) if asked.priority else lane_header or Lane.NORMAL,
        deadline_ms=asked.deadline_ms,
        metadata=metadata,
    )
    try:
        submission = prepare_request(request, key, job, idempotency_key)
    except ApiError as exc:
        raise _named(asked, exc) from exc
    commit: GroupCommit = app_state(request).group_commit
    submitted = await commit.submit(submission)
    if not submitted.replayed:
        JOBS_ACCEPTED.labels(submitted.job.model, submitted.job.priority).inc()
    return submitted


def _named(asked: GenerationRequest, exc: ApiError) -> ApiError:
    """The input check's refusal under OpenAI's name for the field it names."""
    field, sep, why = exc.message.partition(": ")
    if exc.status != 422 or not sep or " " in field:
        return exc
    param = asked.param(field)
    return ApiError(exc.status, exc.type, f"{param}: {why}", exc.headers, param=param)


def _created(job: JobResource) -> int:
    return int(job.created_at.timestamp())


def _finished(asked: GenerationRequest, job: JobResource, headers: dict[str, str]) -> Any:
    if not is_terminal(job):
        raise ApiError(
            504,
            "timeout",
            f"job {job.id} is still {job.status}; it runs all the same (read it at "
            f"/v1/jobs/{job.id}), but this request waited as long as it may",
            headers,
        )
    output = job.output
    if job.status in WITH_OUTPUT and is_generation_output(output):
        return completion_object(
            asked.endpoint, job.id, _created(job), job.model, output, asked.echo_of(asked.input)
        )
    raise _failure(job, headers)


def _failure(job: JobResource, headers: dict[str, str] | None = None) -> ApiError:
    if job.status == "cancelled":
        return ApiError(409, "cancelled", f"job {job.id} was cancelled before it ran", headers)
    if job.status == "expired":
        when = "while it generated" if job.output else "before it ran"
        return ApiError(
            504,
            "expired",
            f"job {job.id} expired: its deadline passed {when}"
            + (f" (what it produced is in /v1/jobs/{job.id})" if job.output else ""),
            headers,
        )
    return ApiError(500, "job_failed", f"job {job.id} {job.status}: {job.error or ''}", headers)


def _data(value: Any) -> bytes:
    return (
        b"data: " + json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    )


def _stream(
    state: AppState,
    key: ApiKey,
    asked: GenerationRequest,
    job: JobResource,
    headers: dict[str, str],
) -> EventStreamResponse:
    endpoint, created = asked.endpoint, _created(job)

    async def chunks() -> AsyncIterator[bytes]:
        if endpoint == "chat":
            yield _data(chunk_object(endpoint, job.id, created, job.model, text="", role=True))
        logprobs = _ChunkLogprobs(endpoint)
        async for seen in follow(state, key.id, job, generation=True):
            if seen is None:
                yield KEEP_ALIVE
                continue
            event = seen.event
            if event.kind == "token" and event.logprob is not None:
                logprobs.add(event.index, event.logprob)  # sent with the next text
            if event.kind == "token" and event.text:
                yield _data(
                    chunk_object(
                        endpoint,
                        job.id,
                        created,
                        job.model,
                        text=event.text,
                        logprobs=logprobs.take(),
                    )
                )
            elif event.kind == "done":
                # The worker commits the row before it writes the done event.
                found = await state.group_read.submit(JobRead(key.id, job.id))
                for chunk in _last_chunks(asked, found, created, logprobs):
                    yield chunk
                yield DONE
                return

    async def disconnected() -> None:
        if asked.cancel_on_disconnect:
            await run_in_threadpool(_cancel_quietly, state, key, job.id)

    return EventStreamResponse(chunks(), headers, disconnected)


@dataclass
class _ChunkLogprobs:
    """The logprobs of a stream's tokens, each sent once: with the chunk of text its
    token made visible (a token that makes none, half a character, waits for the next),
    and those of tokens streamed without them (a model run through ``generate()``
    streams its text at its end) from the job's output, with the last chunk."""

    endpoint: Endpoint
    pending: dict[int, dict[str, Any]] = field(default_factory=dict)  # by token index
    # By index, not counted: a stream may lack some (a takeover by a worker that ran the
    # job again, the tokens already streamed not repeated).
    sent: set[int] = field(default_factory=set)
    chars: int = 0  # the characters of the tokens sent: the legacy text_offset's origin

    def add(self, index: int | None, entry: dict[str, Any]) -> None:
        if index is not None and index not in self.sent:
            self.pending[index] = entry

    def take(self, output: Sequence[Any] = ()) -> dict[str, Any] | None:
        """The pending ones in OpenAI's shape (and, given the output's list, every one of
        it not sent yet); None when there are none."""
        found = self.pending | {i: e for i, e in enumerate(output) if i not in self.sent}
        self.pending = {}
        if not found:
            return None
        entries = [found[i] for i in sorted(found)]
        shaped = logprobs_object(self.endpoint, entries, self.chars)
        self.sent |= set(found)
        self.chars += sum(len(e["text"]) for e in entries)
        return shaped


def _last_chunks(
    asked: GenerationRequest, job: JobResource, created: int, logprobs: _ChunkLogprobs
) -> list[bytes]:
    output = job.output
    if job.status not in WITH_OUTPUT or not is_generation_output(output):
        error = _failure(job)
        return [
            _data(
                {
                    "error": {
                        "message": error.message,
                        "type": "server_error",
                        "param": None,
                        "code": error.type,
                    }
                }
            )
        ]
    last = [
        _data(
            chunk_object(
                asked.endpoint,
                job.id,
                created,
                job.model,
                finish_reason=output["finish_reason"],
                logprobs=logprobs.take(output.get("logprobs") or ()),
            )
        )
    ]
    if asked.include_usage:
        usage = usage_of(output)
        last.append(_data(usage_chunk(asked.endpoint, job.id, created, job.model, usage)))
    return last


def _cancel_quietly(state: AppState, key: ApiKey, job_id: str) -> None:
    with contextlib.suppress(ApiError):  # it ended meanwhile: nothing to stop
        services.cancel_and_announce(state, key, job_id)
