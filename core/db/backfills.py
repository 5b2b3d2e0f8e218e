"""Backfills: a file of inputs in, one job per line, results out in input order.

The upload is read line by line (:class:`Ingest`): each line is checked
against the model's catalog entry and stored as a job in status ``waiting``,
in chunks, each chunk its own transaction (so a long upload never holds the
database's write lock). A waiting job is in no stream; the feeder
(``workers/tasks/feeder.py``) queues waiting jobs into the model's ``bulk`` lane a
chunk at a time, and from there they follow the path of every job. The
backfill's counters are updated in the transaction of each terminal write
(:func:`count_outcomes`), so they are exact.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Table, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from core.db.resources import iso
from core.db.schema import (
    BACKFILL_ACTIVE,
    BACKFILL_DONE,
    TERMINAL_STATUSES,
    WAITING,
    ApiKey,
    Backfill,
    Job,
    utcnow,
)
from core.models.catalog import MAX_JSON_DEPTH, InputError, ModelSpec, text_problem
from scheduler.vocabulary import Lane

MAX_CUSTOM_ID_CHARS = 255
# Terminal job status -> the backfill counter it adds to.
COUNTER = {
    "succeeded": "completed",
    "failed": "failed",
    "expired": "expired",
    "cancelled": "cancelled",
}
DELETE_CHUNK = 10_000


class LineError(ValueError):
    """A line of an upload that cannot be taken; ``line`` counts from 1.

    ``code`` names the kind of fault (OpenAI's batch errors carry it).
    """

    def __init__(
        self, line: int, message: str, status: int = 422, code: str = "invalid_request"
    ) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Item:
    line: int
    custom_id: str
    input: Any
    cost: int
    # Kept as the job's metadata (an OpenAI batch line's options, for its output).
    metadata: dict[str, Any] | None = None


# How an upload's lines become items: (raw line, line number) -> item, None for a blank line.
LineParser = Callable[[bytes, int], Item | None]


def parse_line(
    raw: bytes, line: int, spec: ModelSpec, max_depth: int = MAX_JSON_DEPTH
) -> Item | None:
    """One NDJSON line as an item; None for a blank line. Raises :class:`LineError`."""
    value = decode_line(raw, line, '{"custom_id": ..., "input": ...}')
    if value is None:
        return None
    unknown = sorted(set(value) - {"custom_id", "input"})
    if unknown:
        raise LineError(line, f"unknown field(s): {', '.join(unknown)}")
    if "input" not in value:
        custom_id(value, line)  # a missing custom_id is named first
        raise LineError(line, "input: missing")
    return checked_item(value, line, value["input"], spec, max_depth)


def decode_line(raw: bytes, line: int, shape: str) -> dict[str, Any] | None:
    """A line's JSON object; None for a blank line. ``shape`` describes the object wanted."""
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LineError(line, "not UTF-8", code="invalid_json_line") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise LineError(line, f"not valid JSON ({exc})", code="invalid_json_line") from None
    except RecursionError:
        raise LineError(
            line, "not valid JSON (nested too deeply)", code="invalid_json_line"
        ) from None
    if not isinstance(value, dict):
        raise LineError(line, f"must be a JSON object {shape}", code="invalid_json_line")
    return value


def custom_id(value: Mapping[str, Any], line: int) -> str:
    """The line's custom_id, checked."""
    found = value.get("custom_id")
    if found is None:
        raise LineError(line, "custom_id: missing")
    if not isinstance(found, str) or not found:
        raise LineError(line, "custom_id: must be a non-empty string")
    if len(found) > MAX_CUSTOM_ID_CHARS:
        raise LineError(line, f"custom_id: at most {MAX_CUSTOM_ID_CHARS} characters")
    return found


def checked_item(
    value: Mapping[str, Any],
    line: int,
    model_input: Any,
    spec: ModelSpec,
    max_depth: int = MAX_JSON_DEPTH,
    metadata: dict[str, Any] | None = None,
    input_field: str = "input",
) -> Item:
    """The item of a line whose custom_id is ``value``'s and whose input is ``model_input``,
    checked against the model (errors name the input ``input_field``)."""
    identifier = custom_id(value, line)
    for field, part in (("custom_id", identifier), (input_field, model_input)):
        problem = text_problem(part, max_depth=max_depth)
        if problem:
            raise LineError(line, f"{field}: must not contain {problem}")
    try:
        checked = spec.validate(model_input)
    except InputError as exc:
        field = exc.field.replace("input", input_field, 1)
        raise LineError(line, f"{field}: {exc.message}") from None
    return Item(line, identifier, checked.input, checked.cost, metadata)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def start(
    sessions: sessionmaker[Session],
    key_id: str,
    model: str,
    callback_url: str | None,
    expires_at: dt.datetime | None = None,
) -> str:
    """A new backfill, validating until its upload is whole; returns its id."""
    now = utcnow()
    backfill_id = str(uuid.uuid4())
    with sessions.begin() as session:
        session.add(
            Backfill(
                id=backfill_id,
                api_key_id=key_id,
                model=model,
                status="validating",
                callback_url=callback_url,
                total=0,
                completed=0,
                failed=0,
                expired=0,
                cancelled=0,
                fed_through=0,
                input_bytes=0,
                expires_at=expires_at,
                created_at=now,
                updated_at=now,
            )
        )
    return backfill_id


class Ingest:
    """Stores an upload's lines as waiting jobs, chunk by chunk (sync; run off the event loop)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        backfill_id: str,
        key_id: str,
        spec: ModelSpec,
        max_lines: int,
        max_depth: int = MAX_JSON_DEPTH,
        parse: LineParser | None = None,
    ) -> None:
        self.sessions = sessions
        self.parse: LineParser = parse or (lambda raw, line: parse_line(raw, line, spec, max_depth))
        self.backfill_id = backfill_id
        self.key_id = key_id
        self.spec = spec
        self.max_lines = max_lines
        self.line = 0  # lines read so far, blank ones included
        self.items = 0
        self.bytes = 0
        self.over_lines = False  # refused for having more than max_lines lines

    def add(self, lines: Sequence[bytes]) -> None:
        """Parse and store these lines (the next ones of the file). Raises :class:`LineError`."""
        items: list[Item] = []
        seen: dict[str, int] = {}
        for raw in lines:
            self.line += 1
            self.bytes += len(raw) + 1
            item = self.parse(raw, self.line)
            if item is None:
                continue
            if self.items + len(items) >= self.max_lines:
                self.over_lines = True
                raise LineError(
                    self.line,
                    f"the file has more than {self.max_lines} lines",
                    status=413,
                    code="too_many_tasks",
                )
            if item.custom_id in seen:
                raise LineError(
                    self.line,
                    f"custom_id: {item.custom_id!r} is a duplicate of line {seen[item.custom_id]}",
                    code="duplicate_custom_id",
                )
            seen[item.custom_id] = self.line
            items.append(item)
        if items:
            self._store(items)
        self.items += len(items)

    def _store(self, items: list[Item]) -> None:
        now = utcnow()
        rows = [
            {
                "id": str(uuid.uuid4()),
                "api_key_id": self.key_id,
                "model": self.spec.name,
                "priority": Lane.BULK,
                "status": WAITING,
                "input": item.input,
                "cost": item.cost,
                "attempts": 0,
                "created_at": now,
                "backfill_id": self.backfill_id,
                "line_no": item.line,
                "custom_id": item.custom_id,
                "metadata_": item.metadata,
            }
            for item in items
        ]
        try:
            with self.sessions.begin() as session:
                session.execute(insert(Job), rows)
                session.execute(
                    update(Backfill)
                    .where(Backfill.id == self.backfill_id)
                    .values(
                        total=Backfill.total + len(rows),
                        input_bytes=self.bytes,
                        updated_at=now,
                    )
                )
        except IntegrityError:
            # A custom_id an earlier chunk already has: say which line.
            with self.sessions() as session:
                earlier = dict(
                    session.execute(
                        select(Job.custom_id, Job.line_no).where(
                            Job.backfill_id == self.backfill_id,
                            Job.custom_id.in_([item.custom_id for item in items]),
                        )
                    ).all()
                )
            for item in items:
                if item.custom_id in earlier:
                    raise LineError(
                        item.line,
                        f"custom_id: {item.custom_id!r} is a duplicate of line "
                        f"{earlier[item.custom_id]}",
                        code="duplicate_custom_id",
                    ) from None
            raise

    def finish(self, max_outstanding: int | None = None) -> Backfill:
        """The upload is whole and valid: the backfill starts.

        With ``max_outstanding``, its key's started backfills may then hold at most
        that many unfinished lines, or it does not start (:class:`QuotaExceeded`).
        The check holds the key's row, so uploads finishing together are counted
        one after the other.
        """
        if self.items == 0:
            raise LineError(
                max(self.line, 1), "the file has no lines (expected NDJSON)", code="empty_file"
            )
        now = utcnow()
        with self.sessions.begin() as session:
            if max_outstanding is not None:
                session.execute(select(ApiKey.id).where(ApiKey.id == self.key_id).with_for_update())
            session.execute(
                update(Backfill)
                .where(Backfill.id == self.backfill_id, Backfill.status == "validating")
                .values(status="in_progress", in_progress_at=now, updated_at=now)
            )
            if max_outstanding is not None:
                started = outstanding_lines(session, self.key_id, include_uploads=False)
                if started > max_outstanding:
                    # Raised inside the transaction: the start is rolled back.
                    raise QuotaExceeded(max_outstanding - (started - self.items))
            backfill = session.get(Backfill, self.backfill_id)
            assert backfill is not None
            return backfill

    def abort(self) -> None:
        """The upload was refused or cut: nothing of it stays."""
        discard(self.sessions, self.backfill_id)


class QuotaExceeded(Exception):
    def __init__(self, room: int) -> None:
        super().__init__(f"room for {room} lines")
        self.room = max(room, 0)


def outstanding_lines(session: Session, key_id: str, include_uploads: bool = True) -> int:
    """Lines of the key's unfinished backfills not finished yet (uploads: those stored so far)."""
    finished = Backfill.completed + Backfill.failed + Backfill.expired + Backfill.cancelled
    excluded = BACKFILL_DONE if include_uploads else (*BACKFILL_DONE, "validating")
    total = session.scalar(
        select(func.coalesce(func.sum(Backfill.total - finished), 0))
        .where(Backfill.api_key_id == key_id)
        .where(Backfill.status.not_in(excluded))
    )
    return int(total or 0)


def discard(
    sessions: sessionmaker[Session], backfill_id: str, failed_because: str | None = None
) -> None:
    """Delete a backfill's jobs, in chunks (a long delete must not hold the lock), then the
    backfill itself; or, given a reason, keep it as ``failed`` with that reason."""
    while True:
        with sessions.begin() as session:
            ids = list(
                session.scalars(
                    select(Job.id).where(Job.backfill_id == backfill_id).limit(DELETE_CHUNK)
                )
            )
            if not ids:
                if failed_because is None:
                    session.execute(delete(Backfill).where(Backfill.id == backfill_id))
                else:
                    now = utcnow()
                    session.execute(
                        update(Backfill)
                        .where(Backfill.id == backfill_id)
                        .values(
                            status="failed",
                            error=failed_because,
                            total=0,
                            finished_at=now,
                            updated_at=now,
                        )
                    )
                return
            session.execute(delete(Job).where(Job.id.in_(ids)))


def count_outcomes(session: Session | Connection, outcomes: Mapping[tuple[str, str], int]) -> None:
    """In the caller's transaction (a session's or a connection's): add newly terminal
    jobs to their backfills' counts (``outcomes``: how many jobs of each backfill reached
    each terminal status)."""
    table: Table = Backfill.__table__  # type: ignore[assignment]
    for (backfill_id, status), count in sorted(outcomes.items()):
        column = COUNTER.get(status)
        if column is None:
            continue
        session.execute(
            update(table).where(table.c.id == backfill_id).values({column: table.c[column] + count})
        )


def request_counts(backfill: Backfill) -> dict[str, int]:
    return {
        "total": backfill.total,
        "completed": backfill.completed,
        "failed": backfill.failed,
        "expired": backfill.expired,
        "cancelled": backfill.cancelled,
    }


def eta_s(backfill: Backfill, now: dt.datetime, fallback_rate: float | None) -> float | None:
    """Seconds left at the rate seen so far (or ``fallback_rate`` per second before any)."""
    if backfill.status not in (*BACKFILL_ACTIVE, "finalizing"):
        return None
    left = backfill.total - backfill.done
    if left <= 0:
        return 0.0
    rate = None
    if backfill.in_progress_at is not None and backfill.done > 0:
        elapsed = (now - backfill.in_progress_at).total_seconds()
        if elapsed > 0:
            rate = backfill.done / elapsed
    rate = rate or fallback_rate
    return None if not rate else round(left / rate, 1)


def backfill_resource(backfill: Backfill, eta: float | None = None) -> dict[str, Any]:
    return {
        "id": backfill.id,
        "model": backfill.model,
        "status": backfill.status,
        "callback_url": backfill.callback_url,
        "request_counts": request_counts(backfill),
        "input_bytes": backfill.input_bytes,
        "error": backfill.error,
        "created_at": iso(backfill.created_at),
        "in_progress_at": iso(backfill.in_progress_at),
        "finalizing_at": iso(backfill.finalizing_at),
        "finished_at": iso(backfill.finished_at),
        "cancelling_at": iso(backfill.cancelling_at),
        "expires_at": iso(backfill.expires_at),
        "eta_s": eta,
    }


def terminal_rows(
    sessions: sessionmaker[Session],
    backfill_id: str,
    columns: Sequence[Any],
    page: int = 1000,
) -> Iterator[list[Any]]:
    """The backfill's finished items (``columns`` of each, with ``status``), in input order,
    a page at a time; a running backfill gives what is done so far."""
    after = 0
    while True:
        with sessions() as session:
            rows = session.execute(
                select(Job.line_no, Job.status, *columns)
                .where(Job.backfill_id == backfill_id, Job.line_no > after)
                .order_by(Job.line_no)
                .limit(page)
            ).all()
        if not rows:
            return
        finished = [row for row in rows if row.status in TERMINAL_STATUSES]
        if finished:
            yield finished
        after = rows[-1].line_no


def result_lines(sessions: sessionmaker[Session], backfill_id: str) -> Iterator[bytes]:
    """The finished items as NDJSON, in input order (a running backfill gives what is done)."""
    columns = (Job.custom_id, Job.output, Job.error, Job.model_version)
    for rows in terminal_rows(sessions, backfill_id, columns):
        chunk = []
        for row in rows:
            record: dict[str, Any] = {"custom_id": row.custom_id, "status": row.status}
            if row.model_version is not None:
                record["model_version"] = row.model_version
            if row.status == "succeeded":
                record["output"] = row.output
            else:
                record["error"] = row.error
            chunk.append(json.dumps(record, separators=(",", ":"), ensure_ascii=False))
        yield ("\n".join(chunk) + "\n").encode()
