"""Reads of jobs by id, in groups: one query (and one thread hop) for every read that
arrives together, long-polls woken by one completion message included."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import psycopg
import redis
from sqlalchemy import ARRAY, Connection, Engine, Select, String, any_, bindparam, select
from sqlalchemy.dialects.postgresql import psycopg as pg_dialect
from sqlalchemy.exc import SQLAlchemyError

from api.errors import ApiError
from api.groups import GroupStage
from api.jobs.schemas import JobResource, Progress
from api.jobs.submissions import QueueViews
from core.db.resources import job_resource
from core.db.schema import (
    PG_CONNECT_ARGS,
    POOL_RECYCLE_S,
    TERMINAL_STATUSES,
    Job,
    WebhookDelivery,
)
from core.db.webhooks import TERMINAL_EVENT_TYPES
from core.models.generation_estimates import decode_step_s
from core.streams.events import JobEvent
from core.streams.protocol import ProtocolError, events_key
from core.streams.target import REDIS_ERRORS

if TYPE_CHECKING:
    from api.state import AppState

log = logging.getLogger(__name__)

# Every column under its attribute's name, so that a row reads like a Job, except the
# input: it may be megabytes of images, and a long-poll per job would read and parse it
# each time; of it only what a running generation's progress needs.
_COLUMNS = select(
    *(p.columns[0].label(p.key) for p in Job.__mapper__.column_attrs if p.key != "input"),
    Job.input["prompt_tokens"].label("prompt_tokens"),
    Job.input["max_tokens"].label("max_tokens"),
)
_JOB = _COLUMNS.where(Job.__table__.c.id.in_(bindparam("ids", expanding=True)))


_DELIVERIES = select(WebhookDelivery.__table__).where(
    WebhookDelivery.__table__.c.job_id.in_(bindparam("ids", expanding=True)),
    # A job's callback is its terminal event's (started and progress ones come before).
    WebhookDelivery.__table__.c.event_type.in_(TERMINAL_EVENT_TYPES),
)


@dataclass(frozen=True)
class JobRead:
    key_id: str  # the caller: another key's job reads as missing
    job_id: str


# The process's group read: a job asked for in, its resource out.
GroupRead = GroupStage[JobRead, JobResource]


# The last events of a running generation's stream that are read for its
# progress: its newest token is among them (after it, at most a ``running``
# event per attempt that took it over).
PROGRESS_EVENTS = 8


class GenerationProgress:
    """Running generations' progress: their newest token in their events streams (one
    pipeline for a group of reads) and the decode step time their workers published."""

    def __init__(self, client: redis.Redis, prefix: str, views: QueueViews) -> None:
        self.client = client
        self.prefix = prefix
        self.views = views  # the submissions' own: one read of a model's estimates for both

    def of(self, jobs: Sequence[Any]) -> dict[str, Progress]:
        """Progress of each of ``jobs`` (rows of the group read: a job's columns, and its
        input's ``prompt_tokens`` and ``max_tokens``) that is a running generation (none
        while Redis is unreachable: the read still answers, without it)."""
        running = [
            (job, int(job.max_tokens))
            for job in jobs
            if job.status == "running"
            and job.prompt_tokens is not None
            and isinstance(job.max_tokens, int)
        ]
        if not running:
            return {}
        try:
            pipe = self.client.pipeline(transaction=False)
            for job, _ in running:
                pipe.xrevrange(events_key(self.prefix, job.model, job.id), count=PROGRESS_EVENTS)
            newest = pipe.execute()
            out: dict[str, Progress] = {}
            for (job, max_tokens), entries in zip(running, newest, strict=True):
                tokens = _tokens_so_far(entries)
                out[job.id] = Progress(
                    tokens=tokens,
                    max_tokens=max_tokens,
                    eta_ms=self._eta_ms(job.model, max_tokens, max_tokens - tokens),
                )
            return out
        except REDIS_ERRORS as exc:
            log.warning("progress reads failed", extra={"error_type": type(exc).__name__})
            return {}

    def _eta_ms(self, model: str, max_tokens: int, remaining: int) -> float | None:
        with self.views.lock:
            view = self.views.get(model)
        est = view.generation if view is not None else None
        if est is None or est.execution != "step":
            return None
        return round(max(0, remaining) * decode_step_s(est, 0, max_tokens) * 1000.0, 1)


def _tokens_so_far(entries: Sequence[Any]) -> int:
    """The index after the newest token among a stream's last entries (newest first)."""
    for _id, fields in entries:
        try:
            event = JobEvent.decode(fields)
        except ProtocolError:
            continue
        if event.kind == "token" and event.index is not None:
            return event.index + 1
    return 0


# How long a reading thread keeps its connection before it goes back to the pool.
HELD_S = 60.0


class JobReader:
    """Reads a group of jobs with Core statements on ``engine``'s connections (the API's
    read-only one: no ORM session, no BEGIN/ROLLBACK): the job rows in one query, their
    webhook deliveries in another; with ``progress``, running generations' progress from
    Redis in one pipeline."""

    def __init__(self, engine: Engine, progress: GenerationProgress | None = None) -> None:
        self.engine = engine
        self.progress = progress
        # Each reading thread keeps its connection (a checkout and a return per read were
        # a fifth of a read's CPU), for HELD_S at most: then it goes back to the pool,
        # which recycles it in its time. One that failed goes back at once.
        self._held = threading.local()
        self._idle: set[Connection] = set()  # held by a thread, not reading now
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Connection]:
        held: tuple[Connection, float] | None = getattr(self._held, "connection", None)
        now = time.monotonic()
        with self._lock:
            if held is not None and held[0] not in self._idle:
                held = None  # given back by close()
            elif held is not None:
                self._idle.discard(held[0])
        if held is not None and (held[0].invalidated or now - held[1] > HELD_S):
            _give_back(held[0])
            held = None
        if held is None:
            held = (self.engine.connect(), now)
        self._held.connection = None
        try:
            yield held[0]
        except BaseException:
            _give_back(held[0])  # a failed connection is not kept
            raise
        with self._lock:
            if not self._closed:
                self._idle.add(held[0])
                self._held.connection = held
                return
        _give_back(held[0])

    async def close(self) -> None:
        """Give every thread's connection back to the pool (the API is stopping); one in the
        middle of a read goes back when that read ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, set()
        for connection in idle:
            _give_back(connection)

    def read(self, group: Sequence[JobRead]) -> list[JobResource | Exception]:
        ids = sorted({read.job_id for read in group})
        try:
            with self._connection() as connection:
                rows = {row.id: row for row in connection.execute(_JOB, {"ids": ids})}
                called = _called(rows.values())
                deliveries: dict[str, Any] = {}
                if called:
                    for found in connection.execute(_DELIVERIES, {"ids": called}):
                        deliveries[found.job_id] = found
        except SQLAlchemyError as exc:
            return _unavailable(group, exc)
        progress = self.progress.of(list(rows.values())) if self.progress else {}
        return _answers(group, rows, deliveries, progress)


def _called(rows: Iterable[Any]) -> list[str]:
    """The finished jobs among ``rows`` that have a callback: their deliveries are read too."""
    return [row.id for row in rows if row.callback_url and row.status in TERMINAL_STATUSES]


def _unavailable(group: Sequence[JobRead], exc: Exception) -> list[JobResource | Exception]:
    log.warning("job reads failed", extra={"error_type": type(exc).__name__})
    unavailable = ApiError(
        503, "unavailable", "the database is unavailable; retry shortly", {"Retry-After": "2"}
    )
    return [unavailable] * len(group)


def _answers(
    group: Sequence[JobRead],
    rows: dict[str, Any],
    deliveries: dict[str, Any],
    progress: dict[str, Progress],
) -> list[JobResource | Exception]:
    """Each read's job resource, or a 404 where its job is missing or another key's. The
    rows carry every column but the input under its attribute's name: read as Jobs."""
    out: list[JobResource | Exception] = []
    for read in group:
        row: Any = rows.get(read.job_id)
        if row is None or row.api_key_id != read.key_id:
            out.append(ApiError(404, "not_found", f"no job {read.job_id!r}"))
        else:
            job = cast(Job, row)
            delivery = cast(WebhookDelivery | None, deliveries.get(row.id))
            resource = JobResource.model_validate(job_resource(job, delivery))
            resource.progress = progress.get(row.id)
            out.append(resource)
    return out


_PG = pg_dialect.dialect()
# A listener to the statements a LoopReader sends: the SQL and its parameters.
Sent = Callable[[str, dict[str, Any]], None]


class _PgQuery:
    """A Core select compiled once for psycopg, its ids one array parameter (one prepared
    statement whatever the group's size), its rows named tuples with the columns' own
    result types (UTC datetimes) applied, as SQLAlchemy's execution would."""

    def __init__(self, statement: Select[Any]) -> None:
        compiled = statement.compile(dialect=_PG)
        self.sql = compiled.string
        self.params = {name: value for name, value in compiled.params.items() if value is not None}
        columns = list(statement.selected_columns)
        self.row = namedtuple("Row", [column.key for column in columns])  # type: ignore[misc]
        self.processors: list[tuple[int, Callable[[Any], Any]]] = [
            (at, processor)
            for at, column in enumerate(columns)
            if (processor := column.type.result_processor(_PG, None)) is not None
        ]

    async def rows(
        self, connection: psycopg.AsyncConnection[Any], sent: Sequence[Sent], **params: Any
    ) -> list[Any]:
        bound = self.params | params
        for listener in sent:
            listener(self.sql, bound)
        cursor = await connection.execute(self.sql, bound)
        out = []
        for found in await cursor.fetchall():
            values = list(found)
            for at, processor in self.processors:
                values[at] = processor(values[at])
            out.append(self.row(*values))
        return out


_IDS_ARRAY = bindparam("ids", type_=ARRAY(String))
_PG_JOB = _PgQuery(_COLUMNS.where(Job.__table__.c.id == any_(_IDS_ARRAY)))
_PG_DELIVERIES = _PgQuery(
    select(WebhookDelivery.__table__).where(
        WebhookDelivery.__table__.c.job_id == any_(_IDS_ARRAY),
        WebhookDelivery.__table__.c.event_type
        == any_(bindparam("events", list(TERMINAL_EVENT_TYPES), type_=ARRAY(String))),
    )
)


class LoopReader:
    """:class:`JobReader`'s reads on PostgreSQL from the event loop itself, on psycopg's
    asyncio connections (autocommit: one statement, no transaction): a group's read costs
    no hop to a thread and back, which on the long-poll's path cost the API more CPU than
    the query's own work in this process. One connection per group in flight (the group
    stage's workers), kept between reads; one that failed is closed, and the next read
    opens another."""

    def __init__(self, connect: dict[str, Any], progress: GenerationProgress | None = None) -> None:
        self.connect = connect  # psycopg's connection parameters
        self.progress = progress
        self._idle: list[tuple[psycopg.AsyncConnection[Any], float]] = []
        self._closed = False
        # Called with each statement before it is sent, as SQLAlchemy's
        # ``before_cursor_execute`` is for an engine's (tests count and explain them).
        self.sent: list[Sent] = []

    @classmethod
    def of(cls, engine: Engine, progress: GenerationProgress | None = None) -> LoopReader:
        """The reader of ``engine``'s PostgreSQL database, connecting as its dialect does
        (a URL naming several hosts for failover gives libpq all of them)."""
        _args, connect = engine.dialect.create_connect_args(engine.url)
        connect.pop("context", None)  # the engine's own adaptations, for its connections
        return cls({**connect, **PG_CONNECT_ARGS}, progress)

    async def _kept(self) -> tuple[psycopg.AsyncConnection[Any], float] | None:
        """A connection kept from an earlier read, if one is still young enough."""
        now = time.monotonic()
        while self._idle:
            connection, opened = self._idle.pop()
            if not connection.closed and now - opened < POOL_RECYCLE_S:
                return connection, opened
            await connection.close()
        return None

    async def _query(
        self, connection: psycopg.AsyncConnection[Any], ids: list[str]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The jobs' rows by id, and the terminal webhook deliveries of those with one."""
        rows = {row.id: row for row in await _PG_JOB.rows(connection, self.sent, ids=ids)}
        deliveries: dict[str, Any] = {}
        if called := _called(rows.values()):
            for found in await _PG_DELIVERIES.rows(connection, self.sent, ids=called):
                deliveries[found.job_id] = found
        return rows, deliveries

    async def _query_or_close(
        self, connection: psycopg.AsyncConnection[Any], ids: list[str]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        try:
            return await self._query(connection, ids)
        except BaseException:
            # Failed, or cancelled mid-read (the API stopping): its state is not known,
            # so it is closed, never kept.
            await connection.close()
            raise

    async def _fetch(
        self, ids: list[str]
    ) -> tuple[tuple[psycopg.AsyncConnection[Any], float], tuple[dict[str, Any], dict[str, Any]]]:
        """The connection that read and what it read: on a kept connection, or on a new one
        where none is kept or the server has closed the kept one since (a restart, a
        failover, idle sessions ended: a read is safe to repeat)."""
        held = await self._kept()
        if held is not None:
            with contextlib.suppress(psycopg.OperationalError):
                return held, await self._query_or_close(held[0], ids)
        connection = await psycopg.AsyncConnection.connect(autocommit=True, **self.connect)
        return (connection, time.monotonic()), await self._query_or_close(connection, ids)

    async def read(self, group: Sequence[JobRead]) -> list[JobResource | Exception]:
        try:
            held, found = await self._fetch(sorted({read.job_id for read in group}))
        except psycopg.Error as exc:
            return _unavailable(group, exc)
        if self._closed:
            await held[0].close()
        else:
            self._idle.append(held)
        rows, deliveries = found
        progress: dict[str, Progress] = {}
        if self.progress is not None and any(row.status == "running" for row in rows.values()):
            # Redis's reads of running generations' progress, in a thread: they block.
            progress = await asyncio.to_thread(self.progress.of, list(rows.values()))
        return _answers(group, rows, deliveries, progress)

    async def close(self) -> None:
        """Close the connections kept between reads (the API is stopping)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection, _ in idle:
            await connection.close()


def _give_back(connection: Connection) -> None:
    with contextlib.suppress(SQLAlchemyError):
        connection.close()


def is_terminal(resource: JobResource) -> bool:
    return resource.status in TERMINAL_STATUSES


def succeeded_output(job: JobResource, where: str) -> Any:
    """The output of a job a request waited for: 504 if it still runs, 500 if it did not
    succeed. ``where``: the request's part the job is (``input[3]``, ``row 3``)."""
    if not is_terminal(job):
        raise ApiError(
            504,
            "timeout",
            f"{where} is still {job.status} (job {job.id}); it runs all the same, "
            "but this request waited as long as it may",
        )
    if job.status != "succeeded":
        raise ApiError(500, "job_failed", f"{where}: {job.status}: {job.error or ''}")
    return job.output


# A waiting request looks at the API's drain flag this often (it reads the
# job's row only when a completion wakes it, and once at the end).
DRAIN_CHECK_S = 1.0


async def until_terminal(state: AppState, wanted: JobRead, wait: float) -> JobResource:
    """The job once it is terminal, or as it is after ``wait`` seconds (or when draining).

    ``state``: the app's state (its completion hub and its group read).
    """
    hub, reads = state.hub, state.group_read
    loop = asyncio.get_running_loop()
    until = loop.time() + wait
    # Watched before the first read, so a completion right after it still wakes us.
    with hub.watch(wanted.job_id) as woken:
        # A job this process accepted whose completion has not come has not ended: its
        # row is first read when woken (the read at the end covers a completion lost).
        found = None if hub.unended(wanted.job_id, wanted.key_id) else await reads.submit(wanted)
        while found is None or not is_terminal(found):
            remaining = until - loop.time()
            if remaining <= 0 or state.draining:
                break  # timed out, or the API is stopping: answer with the state now
            try:
                # The row is read again only when woken (the woken of one
                # completion message share one read); the timeout only
                # notices a drain.
                await asyncio.wait_for(woken.wait(), timeout=min(remaining, DRAIN_CHECK_S))
            except TimeoutError:
                continue
            woken.clear()
            found = await reads.submit(wanted)
        if found is None or not is_terminal(found):
            # One read at the wait's end covers a notification that never came.
            found = await reads.submit(wanted)
    if is_terminal(found):
        hub.ended([wanted.job_id])
    return found
