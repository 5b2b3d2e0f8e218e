"""What ``POST /v1/completions`` and ``POST /v1/chat/completions`` do.

Each choice of a request (``n``, one by default) is one Ferry job, the
request's jobs submitted together with the same admission as ``POST
/v1/jobs`` (the group commit: quota, deadline, durable before anything is
answered), then waited for: the finished jobs as OpenAI's
``text_completion`` or ``chat.completion``, or, with ``stream: true``, their
events streams as OpenAI's chunks (``api.jobs.events``), each choice's under
its index. The jobs are durable: a client that disconnects from a stream
leaves them running (unless it asked for ``ferry_cancel_on_disconnect``), and
every answer carries the first job's id in ``X-Ferry-Job-Id`` (every one's in
``X-Ferry-Job-Ids``) so results can be read later from ``/v1/jobs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import anyio
from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from api.errors import ApiError
from api.jobs import service as services
from api.jobs.events import KEEP_ALIVE, EventStreamResponse, follow
from api.jobs.reads import JobRead, is_terminal, until_terminal
from api.jobs.schemas import JobCreate, JobResource
from api.jobs.submissions import (
    GroupCommit,
    Submission,
    Submitted,
    prepare_request,
    withdraw,
)
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
    total_usage,
    unscored,
    usage_chunk,
)
from api.state import app_state
from core.db.schema import ApiKey
from core.ops.metrics import JOBS_ACCEPTED
from core.streams.target import REDIS_ERRORS
from scheduler.vocabulary import Lane

log = logging.getLogger(__name__)
OUTAGES: tuple[type[Exception], ...] = (SQLAlchemyError, *REDIS_ERRORS)

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
    most = state.settings.max_outstanding_jobs
    if asked.choices > most:
        param = "n" if asked.n > 1 else "prompt"
        raise ApiError(
            422,
            "invalid_request",
            f"{param}: the request is {asked.choices} jobs, more than a key may have "
            f"outstanding ({most}, FERRY_MAX_OUTSTANDING_JOBS): it could never be admitted",
            param=param,
        )
    submitted = await _submit(request, key, asked, body["model"], lane_header, idempotency_key)
    first = submitted[0].job
    headers = {"X-Ferry-Job-Id": first.id, "Location": f"/v1/jobs/{first.id}"}
    if len(submitted) > 1:
        headers["X-Ferry-Job-Ids"] = ",".join(s.job.id for s in submitted)
    resources = [services.to_resource(s.job) for s in submitted]
    if asked.stream:
        return _stream(state, key, asked, resources, headers)
    found = await asyncio.gather(
        *(
            until_terminal(state, JobRead(key.id, job.id), state.settings.max_wait_s)
            for job in resources
        )
    )
    stored = [s.job.input for s in submitted]
    return JSONResponse(_finished(asked, found, stored, headers), headers=headers)


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
) -> list[Submitted]:
    """The request's jobs, one a choice, committed in one group."""
    metadata: dict[str, Any] = {
        "openai": "chat.completions" if asked.endpoint == "chat" else "completions"
    }
    if asked.user is not None:
        metadata["user"] = asked.user
    several = asked.choices > 1
    submissions: list[Submission] = []
    for prompt in range(max(1, len(asked.prompts))):
        index = prompt * asked.n
        job = JobCreate(
            model=model,
            input=asked.choice_input(index),
            priority=Lane(asked.priority) if asked.priority else lane_header or Lane.NORMAL,
            deadline_ms=asked.deadline_ms,
            metadata=metadata | ({"choice": index} if several else {}),
        )
        try:
            first = prepare_request(request, key, job, _choice_key(idempotency_key, index))
        except ApiError as exc:
            raise _named(asked, exc, prompt if len(asked.prompts) > 1 else None) from exc
        # The prompt's next choices differ from its first by their seed alone: checked once.
        submissions += [first] + [
            _choice(first, asked, index + draw, idempotency_key) for draw in range(1, asked.n)
        ]
    state = app_state(request)
    commit: GroupCommit = state.group_commit
    if not several:
        submitted = [await commit.submit(submissions[0])]
    else:
        outcomes = await commit.submit_each(submissions)
        submitted = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, BaseException)]
        if refused:
            # All or nothing: a request some of whose choices were refused (the key's
            # quota, the queue's bound) is refused whole, the ones admitted taken back.
            taken = [done.job.id for done in submitted if not done.replayed]
            await run_in_threadpool(_take_back, state, key, taken)
            raise refused[0]
    for done in submitted:
        if not done.replayed:
            JOBS_ACCEPTED.labels(done.job.model, done.job.priority).inc()
    return submitted


def _choice(
    first: Submission, asked: GenerationRequest, index: int, idempotency_key: str | None
) -> Submission:
    """Choice ``index``'s submission: the first's, with its own seed (when one was given),
    metadata and idempotency key."""
    seeded = asked.choice_input(index)
    body = first.body.model_copy(
        update={"input": seeded, "metadata": {**(first.body.metadata or {}), "choice": index}}
    )
    stored = first.input | ({"seed": seeded["seed"]} if "seed" in seeded else {})
    return replace(
        first, body=body, input=stored, idempotency_key=_choice_key(idempotency_key, index)
    )


def _choice_key(key: str | None, index: int) -> str | None:
    """Choice ``index``'s idempotency key: the request's own for the first, a derived one
    in a namespace of its own for the next (a replay of the request finds every choice's
    job, and no key a client chose collides with one derived from another)."""
    if key is None or index == 0:
        return key
    digest = hashlib.sha256(f"{index}\0{key}".encode()).hexdigest()
    return f"ferry-choice-{index}-{digest}"


def _take_back(state: AppState, key: ApiKey, job_ids: list[str]) -> None:
    """Delete the admitted jobs still queued; cancel any a worker took meanwhile. An
    outage here leaves them accepted (they run, readable at /v1/jobs): the request is
    refused all the same."""
    try:
        started = withdraw(state, key.id, job_ids)
    except SQLAlchemyError:
        log.warning("a refused request's jobs could not be taken back; kept", exc_info=True)
        return
    for job_id in started:
        try:
            _cancel_quietly(state, key, job_id)
        except OUTAGES:
            log.warning("a refused request's running job was not cancelled", exc_info=True)


def _named(asked: GenerationRequest, exc: ApiError, prompt: int | None = None) -> ApiError:
    """The input check's refusal under OpenAI's name for the field it names (``prompt``:
    which of a list of prompts it was, ``prompt[2]``)."""
    field, sep, why = exc.message.partition(": ")
    if exc.status != 422 or not sep or " " in field:
        return exc
    param = asked.param(field)
    if prompt is not None and param.startswith("prompt"):
        param = f"prompt[{prompt}]{param.removeprefix('prompt')}"
    return ApiError(exc.status, exc.type, f"{param}: {why}", exc.headers, param=param)


def _created(job: JobResource) -> int:
    return int(job.created_at.timestamp())


def _finished(
    asked: GenerationRequest,
    jobs: Sequence[JobResource],
    stored: Sequence[Any],
    headers: dict[str, str],
) -> Any:
    """The finished jobs (``stored``: their inputs as stored) as one completion."""
    outputs = []
    for job, kept in zip(jobs, stored, strict=True):
        if not is_terminal(job):
            raise ApiError(
                504,
                "timeout",
                f"job {job.id} is still {job.status}; it runs all the same (read it at "
                f"/v1/jobs/{job.id}), but this request waited as long as it may",
                headers,
            )
        if job.status not in WITH_OUTPUT or not is_generation_output(job.output):
            raise _failure(job, headers)
        if unscored(kept, job.output):
            raise ApiError(
                409 if job.status == "cancelled" else 500,
                "cancelled" if job.status == "cancelled" else "job_failed",
                f"job {job.id} {job.status} before its prompt was scored: the prompt has no "
                "logprobs to echo",
                headers,
            )
        outputs.append(job.output)
    first = jobs[0]
    echoes = [asked.echo_of(kept) for kept in stored]
    created = _created(first)
    return completion_object(
        asked.endpoint, first.id, created, first.model, outputs, echoes, asked.n
    )


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
    jobs: list[JobResource],
    headers: dict[str, str],
) -> EventStreamResponse:
    first = jobs[0]
    endpoint, created, model = asked.endpoint, _created(first), first.model

    def chunk(index: int, **fields: Any) -> bytes:
        return _data(chunk_object(endpoint, first.id, created, model, index=index, **fields))

    async def chunks() -> AsyncIterator[bytes]:
        if endpoint == "chat":
            for index in range(len(jobs)):
                yield chunk(index, text="", role=True)
        logprobs = [_ChunkLogprobs(endpoint) for _ in jobs]
        outputs: dict[int, Any] = {}  # by choice
        streams = [follow(state, key.id, job, generation=True) for job in jobs]
        async with contextlib.aclosing(_merged(streams)) as merged:
            async for index, seen in merged:
                if seen is None:
                    yield KEEP_ALIVE
                    continue
                event = seen.event
                if event.kind == "token" and event.logprob is not None:
                    logprobs[index].add(event.index, event.logprob)  # sent with the next text
                if event.kind == "token" and event.text:
                    yield chunk(index, text=event.text, logprobs=logprobs[index].take())
                elif event.kind == "done":
                    # The worker commits the row before it writes the done event.
                    found = await state.group_read.submit(JobRead(key.id, jobs[index].id))
                    output = found.output
                    if found.status not in WITH_OUTPUT or not is_generation_output(output):
                        yield _error_chunk(found)
                        yield DONE
                        return
                    taken = logprobs[index].take(output.get("logprobs") or ())
                    yield chunk(index, finish_reason=output["finish_reason"], logprobs=taken)
                    outputs[index] = output
        if len(outputs) < len(jobs):
            return  # the API is draining: the client reads the jobs later
        if asked.include_usage:
            usage = total_usage([outputs[i] for i in range(len(jobs))], asked.n)
            yield _data(usage_chunk(endpoint, first.id, created, model, usage))
        yield DONE

    async def disconnected() -> None:
        if asked.cancel_on_disconnect:
            for job in jobs:
                await run_in_threadpool(_cancel_quietly, state, key, job.id)

    return EventStreamResponse(chunks(), headers, disconnected)


_END = object()


async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncGenerator[tuple[int, Any]]:
    """The items of every stream as they come, each with its stream's index; ends when
    they have all ended, re-raises what one raised."""
    if len(streams) == 1:
        # follow() is an async generator (typed as the iterator it is used as).
        async with contextlib.aclosing(cast(AsyncGenerator[Any], streams[0])) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, _END))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            index, item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # Shielded, and asyncio.wait, which cancels nothing when cancelled: a disconnect
        # cancels this scope at every await, and a second cancel of the pumps would cut
        # the shielded close of their events clients short.
        with anyio.CancelScope(shield=True):
            await asyncio.wait(tasks)


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


def _error_chunk(job: JobResource) -> bytes:
    error = _failure(job)
    return _data(
        {
            "error": {
                "message": error.message,
                "type": "server_error",
                "param": None,
                "code": error.type,
            }
        }
    )


def _cancel_quietly(state: AppState, key: ApiKey, job_id: str) -> None:
    with contextlib.suppress(ApiError):  # it ended meanwhile: nothing to stop
        services.cancel_and_announce(state, key, job_id)
