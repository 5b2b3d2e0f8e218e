"""A job's events as they happen: what ``GET /v1/jobs/{id}/events`` and the OpenAI
routes' ``stream: true`` read.

A generation's worker writes its events to the job's events stream
(``core.streams.protocol.events_key``, entries of ``core.streams.events.JobEvent``);
:func:`follow` reads that stream from the start or after the last event a client saw
(the entry ids are the events' ids) until the ``done`` event: while the job runs,
as the process's one blocked XREAD of its model's streams hands its entries over
(``api.jobs.tails``), and once it has ended, what is left of it at once. A job that
ends without writing one (cancelled or expired while queued, failed by the
reconciler) is noticed through the process's done-channel subscription, as
long-polls are, and ends with a ``done`` made from its row; so does a finished job
whose stream has expired. A job of an encoder model writes no events: for it
:func:`follow` waits on the done channel only.

Nothing here outlives its reader: a client that disconnects cancels the response,
and its place among the stream's readers is given up with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.errors import ApiError
from api.jobs.reads import JobRead, is_terminal, until_terminal
from api.jobs.schemas import JobResource
from core.streams.events import JobEvent
from core.streams.protocol import ProtocolError, events_key

if TYPE_CHECKING:
    from api.state import AppState

log = logging.getLogger(__name__)

# A comment line this often keeps proxies from closing a quiet stream.
HEARTBEAT_S = 15.0
# One XREAD blocks at most this long, so a job that ends without a done event
# (its done-channel message) is noticed within it.
BLOCK_MS = 2000
KEEP_ALIVE = b": keep-alive\n\n"
_STREAM_ID = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")
FIRST = "0-0"


@dataclass(frozen=True)
class Seen:
    """An event and its id: the stream entry's, or None for one made from the row."""

    event: JobEvent
    id: str | None = None


def sse(kind: str, data: Any, event_id: str | None = None) -> bytes:
    """One Server-Sent Events message (``data`` as one line of JSON)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}event: {kind}\ndata: {body}\n\n".encode()


def resume_after(header: str | None) -> str | None:
    """The event id a ``Last-Event-ID`` header names (None: read from the start)."""
    if header is None or not header.strip():
        return None
    value = header.strip()
    # Each part an unsigned 64-bit number, as Redis's: a larger one would fail the read
    # of every stream this process follows for the model (api.jobs.tails).
    if not _STREAM_ID.match(value) or any(int(part) >= 2**64 for part in value.split("-")):
        raise ApiError(
            422,
            "invalid_request",
            f"Last-Event-ID: {value[:64]!r} is not an event id this API sent",
        )
    return value


def done_of(job: JobResource) -> JobEvent:
    """The done event of a finished job, from its row."""
    output = job.output if isinstance(job.output, dict) else {}
    reason = output.get("finish_reason")
    return JobEvent.done(job.status, reason if isinstance(reason, str) else None)


async def follow(
    state: AppState,
    key_id: str,
    job: JobResource,
    *,
    generation: bool,
    after: str | None = None,
    heartbeat_s: float | None = None,
    block_ms: int | None = None,
) -> AsyncIterator[Seen | None]:
    """The job's events until its ``done`` (None: nothing happened for ``heartbeat_s``).

    ``state``: the app's state (settings, completion hub, stream readers, group
    read); ``job``: the job as read when the client came; ``after``: the last event
    id the client saw. Ends early, without a done, when the API drains.
    ``heartbeat_s`` and ``block_ms`` (how long a wait for events lasts before the
    job's row is looked at again) default to HEARTBEAT_S and BLOCK_MS.
    """
    heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
    block_ms = BLOCK_MS if block_ms is None else block_ms
    if not generation:
        async for seen in _until_done(state, key_id, job, heartbeat_s):
            yield seen
        return
    async for seen in _read(state, key_id, job, after, heartbeat_s, block_ms):
        yield seen


async def _until_done(
    state: AppState, key_id: str, job: JobResource, heartbeat_s: float
) -> AsyncIterator[Seen | None]:
    found = job
    while not is_terminal(found):
        if state.draining:
            return
        found = await until_terminal(state, JobRead(key_id, job.id), heartbeat_s)
        if not is_terminal(found):
            yield None
    yield Seen(done_of(found))


async def _read(
    state: AppState,
    key_id: str,
    job: JobResource,
    after: str | None,
    heartbeat_s: float,
    block_ms: int,
) -> AsyncIterator[Seen | None]:
    key = events_key(state.settings.key_prefix, job.model, job.id)
    last = after or FIRST
    clock = anyio.current_time
    tails = state.tails
    with state.hub.watch(job.id) as woken:
        finished = job if is_terminal(job) else None
        if finished is not None and not await tails.client.exists(key):
            yield Seen(done_of(finished))  # expired long ago
            return
        quiet_since = clock()
        with contextlib.ExitStack() as scope:
            # Followed as it grows only while it runs (a job does not run again once it
            # has ended).
            tail = None if finished else scope.enter_context(tails.tail(job.model, key, last))
            while True:
                # A finished job's stream holds all it will: what is left of it is read at
                # once, without waiting (and what its tail was handed is left unread).
                if finished is None and tail is not None:
                    entries = await tail.next(block_ms)
                else:
                    entries = await tails.read_now(key, last)
                for entry_id, fields in entries:
                    last = entry_id
                    try:
                        event = JobEvent.decode(fields)
                    except ProtocolError as exc:
                        log.warning(
                            "malformed job event", extra={"job_id": job.id, "error": str(exc)}
                        )
                        continue
                    yield Seen(event, entry_id)
                    if event.kind == "done":
                        return
                if entries:
                    quiet_since = clock()
                elif finished is not None:
                    yield Seen(done_of(finished))  # it ended without a done event
                    return
                if woken.is_set():
                    woken.clear()
                    found = await state.group_read.submit(JobRead(key_id, job.id))
                    finished = found if is_terminal(found) else None
                if state.draining:
                    return
                if clock() - quiet_since >= heartbeat_s:
                    quiet_since = clock()
                    yield None


class EventStreamResponse(StreamingResponse):
    """``text/event-stream``, cancelled the moment the client disconnects.

    Starlette listens for the disconnect only for servers of ASGI spec
    versions before 2.4; a reader blocked in XREAD must not wait for its next
    write to find its client gone, whatever the server.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        headers: MutableMapping[str, str] | None = None,
        on_disconnect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        headers = dict(headers or {})
        headers.setdefault("Cache-Control", "no-cache")
        headers.setdefault("X-Accel-Buffering", "no")  # nginx: send each event as it comes
        super().__init__(content, headers=headers)
        self.on_disconnect = on_disconnect
        self.completed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                await self.stream_response(send)
                self.completed = True
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        if not self.completed and self.on_disconnect is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await self.on_disconnect()
                except Exception as exc:  # the client is gone: nobody to tell but the log
                    log.warning("after a disconnect", extra={"error_type": type(exc).__name__})
