"""What the OpenAI-compatible Files and Batch routes do (sync; run off the event loop).

An uploaded file keeps its bytes in ``file_parts``, a part per row, written a
few parts per transaction so a long upload never holds the database's write
lock. Creating a batch reads the file back line by line into a backfill
(:class:`core.db.backfills.Ingest` with :class:`api.batches.lines.RequestLines`):
the answer is the batch in progress, or failed with the errors of the file.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Iterator
from typing import IO, Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.backfills import service as backfill_services
from api.batches import lines as openai_batches
from api.batches.lines import ERROR, OUTPUT
from api.errors import ApiError
from api.models.service import UnknownModel, resolve_model
from api.state import ApiSettings
from backends.catalog import LiveVersions
from core.db import backfills
from core.db.schema import (
    BACKFILL_DONE,
    ApiKey,
    Backfill,
    FilePart,
    OpenAIBatch,
    StoredFile,
    utcnow,
)
from core.models.catalog import ModelSpec

PART_BYTES = 1 << 20
PARTS_PER_TRANSACTION = 8
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]-]*): ")


def store_upload(
    sessions: sessionmaker[Session],
    key: ApiKey,
    source: IO[bytes],
    filename: str,
    expires_at: dt.datetime | None,
    max_bytes: int,
) -> StoredFile:
    """Store an uploaded batch input file. Refused (and nothing kept) over ``max_bytes``."""
    # Its bytes are set once the last part is in: a file cut off mid-way is never served.
    file_id = _file_to_come(sessions, key.id, "batch", filename, expires_at=expires_at)
    size = 0
    part = 0
    try:
        while True:
            pieces: list[bytes] = []
            while len(pieces) < PARTS_PER_TRANSACTION and (data := source.read(PART_BYTES)):
                pieces.append(data)
            size += sum(map(len, pieces))
            if size > max_bytes:
                raise ApiError(413, "payload_too_large", f"file: larger than {max_bytes} bytes")
            if not pieces:
                break
            with sessions.begin() as session:
                for data in pieces:
                    session.add(FilePart(file_id=file_id, part=part, data=data))
                    part += 1
        if size == 0:
            raise ApiError(422, "invalid_request", "file: is empty")
        with sessions.begin() as session:
            session.execute(update(StoredFile).where(StoredFile.id == file_id).values(bytes=size))
            stored = session.get(StoredFile, file_id)
            assert stored is not None
            session.expunge(stored)
            return stored
    except BaseException:
        _drop_parts(sessions, file_id, drop_file=True)
        raise


def _file_to_come(
    sessions: sessionmaker[Session], api_key_id: str, purpose: str, filename: str, **columns: Any
) -> str:
    """Commit a new file's row, its bytes still to come (None: not served until set); its id."""
    file_id = openai_batches.new_file_id()
    with sessions.begin() as session:
        session.add(
            StoredFile(
                id=file_id,
                api_key_id=api_key_id,
                purpose=purpose,
                filename=filename,
                bytes=None,
                created_at=utcnow(),
                **columns,
            )
        )
    return file_id


def _drop_parts(sessions: sessionmaker[Session], file_id: str, drop_file: bool) -> None:
    with sessions.begin() as session:
        session.execute(delete(FilePart).where(FilePart.file_id == file_id))
        if drop_file:
            session.execute(delete(StoredFile).where(StoredFile.id == file_id))


def get_file(session: Session, key: ApiKey, file_id: str, param: str = "file_id") -> StoredFile:
    """The key's file, whole and not deleted or expired, or a 404."""
    found = session.get(StoredFile, file_id)
    if (
        found is None
        or found.api_key_id != key.id
        or found.deleted_at is not None
        or (found.purpose == "batch" and found.bytes is None)
        or (found.expires_at is not None and found.expires_at <= utcnow())
    ):
        raise ApiError(404, "not_found", f"{param}: no file {file_id!r}")
    return found


def stored_file(sessions: sessionmaker[Session], key: ApiKey, file_id: str) -> StoredFile:
    """The key's file as :func:`get_file` finds it, in a session of its own."""
    with sessions() as session:
        return get_file(session, key, file_id)


def file_object(sessions: sessionmaker[Session], stored: StoredFile) -> dict[str, Any]:
    """OpenAI's file object. An output file's size is counted the first time it is asked for."""
    size = stored.bytes
    if size is None:
        size = sum(len(chunk) for chunk in file_content(sessions, stored))
        with sessions.begin() as session:
            session.execute(update(StoredFile).where(StoredFile.id == stored.id).values(bytes=size))
    return {
        "id": stored.id,
        "object": "file",
        "bytes": size,
        "created_at": int(stored.created_at.timestamp()),
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
        "expires_at": None if stored.expires_at is None else int(stored.expires_at.timestamp()),
        "status_details": None,
    }


def list_files(
    sessions: sessionmaker[Session],
    key: ApiKey,
    purpose: str | None,
    limit: int,
    after: str | None,
    ascending: bool,
) -> dict[str, Any]:
    with sessions() as session:
        query = select(StoredFile).where(
            StoredFile.api_key_id == key.id,
            StoredFile.deleted_at.is_(None),
            StoredFile.expires_at.is_(None) | (StoredFile.expires_at > utcnow()),
            # An upload still arriving has no size yet; an output file may not have one yet.
            (StoredFile.bytes.is_not(None)) | (StoredFile.purpose == "batch_output"),
        )
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        rows = _page(session, query, StoredFile, key.id, after, limit, ascending)
    return _list([file_object(sessions, row) for row in rows[:limit]], len(rows) > limit)


def _page(
    session: Session,
    query: Any,
    kind: Any,  # StoredFile or OpenAIBatch: both have id, api_key_id and created_at
    key_id: str,
    after: str | None,
    limit: int,
    ascending: bool,
) -> list[Any]:
    """One page of a list ordered by creation (then id), after the row ``after`` names;
    one row more than ``limit``, to tell whether there are more."""
    if after is not None:
        cursor = session.get(kind, after)
        # Another key's id is no cursor: it must not tell that it exists.
        if cursor is None or cursor.api_key_id != key_id:
            raise ApiError(422, "invalid_request", f"after: no such id {after!r}")
        if ascending:
            query = query.where(
                (kind.created_at > cursor.created_at)
                | ((kind.created_at == cursor.created_at) & (kind.id > cursor.id))
            )
        else:
            query = query.where(
                (kind.created_at < cursor.created_at)
                | ((kind.created_at == cursor.created_at) & (kind.id < cursor.id))
            )
    order = (
        (kind.created_at.asc(), kind.id.asc())
        if ascending
        else (kind.created_at.desc(), kind.id.desc())
    )
    return list(session.scalars(query.order_by(*order).limit(limit + 1)))


def _list(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


def file_content(sessions: sessionmaker[Session], stored: StoredFile) -> Iterator[bytes]:
    """The file's bytes: an upload's parts in order, or a batch's lines rendered from its jobs."""
    if stored.purpose == "batch_output":
        with sessions() as session:
            batch = session.get(OpenAIBatch, stored.batch_id)
        if batch is None or batch.backfill_id is None or batch.model is None:
            return
        role = stored.role or OUTPUT
        yield from openai_batches.file_lines(
            sessions, batch.backfill_id, batch.model, role, batch.endpoint
        )
        return
    part = read = 0
    while True:
        with sessions() as session:
            data = session.scalar(
                select(FilePart.data).where(FilePart.file_id == stored.id, FilePart.part == part)
            )
        if data is None:
            if read != stored.bytes:
                # Deleted while it was read: a part of it is not the file.
                raise ApiError(409, "conflict", f"file {stored.id!r} was deleted while it was read")
            return
        read += len(data)
        yield data
        part += 1


def delete_file(sessions: sessionmaker[Session], key: ApiKey, file_id: str) -> dict[str, Any]:
    """Delete the file. An upload's bytes go; a batch's output stays in its jobs, unlisted."""
    with sessions.begin() as session:
        stored = get_file(session, key, file_id)
        stored.deleted_at = utcnow()
    if stored.purpose == "batch":
        _drop_parts(sessions, file_id, drop_file=False)
    return {"id": file_id, "object": "file", "deleted": True}


def _upload_lines(sessions: sessionmaker[Session], stored: StoredFile) -> Iterator[bytes]:
    """The file's lines (without their newlines), read a part at a time."""
    rest = b""
    for data in file_content(sessions, stored):
        lines = (rest + data).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def create_batch(
    sessions: sessionmaker[Session],
    key: ApiKey,
    request: Any,
    catalog: dict[str, ModelSpec],
    versions: LiveVersions,
    settings: ApiSettings,
) -> str:
    """Check the request, read its file into a backfill; returns the batch's id.

    A fault in the file fails the batch (kept, with OpenAI's errors: code,
    line, param, message) and keeps nothing of the file's lines. A fault in
    the request itself is an HTTP error and makes no batch.
    """
    if request.endpoint not in openai_batches.ENDPOINTS:
        raise ApiError(
            422,
            "invalid_request",
            f"endpoint: {request.endpoint!r}; Ferry runs batches of "
            + ", ".join(openai_batches.ENDPOINTS),
        )
    try:
        hours = openai_batches.window_hours(request.completion_window)
    except ValueError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None
    problem = openai_batches.metadata_problem(request.metadata)
    if problem:
        raise ApiError(422, "invalid_request", f"metadata: {problem}")
    with sessions() as session:
        stored = get_file(session, key, request.input_file_id, param="input_file_id")
    if stored.purpose != "batch":
        raise ApiError(
            422,
            "invalid_request",
            f"input_file_id: {stored.id!r} is a batch's output, not a file uploaded "
            "with purpose batch",
        )
    now = utcnow()
    batch = OpenAIBatch(
        id=openai_batches.new_batch_id(),
        api_key_id=key.id,
        endpoint=request.endpoint,
        input_file_id=stored.id,
        completion_window=request.completion_window,
        metadata_=request.metadata,
        created_at=now,
    )
    lines = _upload_lines(sessions, stored)
    head: list[bytes] = []
    try:
        model = None
        for raw in lines:
            head.append(raw)
            model = openai_batches.request_model(raw, len(head))
            if model is not None:
                break
        if model is None:
            raise backfills.LineError(
                max(len(head), 1), "the file has no requests (expected JSONL)", code="empty_file"
            )
        spec = _batch_model(catalog, versions, model, len(head), request.endpoint)
    except backfills.LineError as exc:
        return _failed(sessions, batch, exc)
    batch.model = spec.name
    room = backfill_services.backfill_room(sessions, key, settings.max_outstanding_backfill_lines)
    backfill_id = backfills.start(
        sessions, key.id, spec.name, None, expires_at=now + dt.timedelta(hours=hours)
    )
    batch.backfill_id = backfill_id
    with sessions.begin() as session:
        session.add(batch)
    max_lines = min(settings.backfill_max_lines, room)
    ingest = backfills.Ingest(
        sessions,
        backfill_id,
        key.id,
        spec,
        max_lines,
        settings.max_json_depth,
        parse=openai_batches.RequestLines(request.endpoint, model, spec, settings.max_json_depth),
    )
    try:
        for chunk in _chunks(head, lines, backfill_services.CHUNK_LINES):
            ingest.add(chunk)
        ingest.finish(settings.max_outstanding_backfill_lines)
    except backfills.QuotaExceeded as exc:
        _abandon(sessions, ingest, batch.id)
        raise backfill_services.quota_error(
            settings.max_outstanding_backfill_lines, exc.room
        ) from None
    except backfills.LineError as exc:
        if exc.status == 413 and max_lines < settings.backfill_max_lines and ingest.over_lines:
            _abandon(sessions, ingest, batch.id)
            raise backfill_services.quota_error(
                settings.max_outstanding_backfill_lines, room
            ) from None
        backfills.discard(sessions, backfill_id, failed_because=str(exc))
        _record_errors(sessions, batch.id, exc)
    except BaseException:
        _abandon(sessions, ingest, batch.id)
        raise
    return batch.id


def _chunks(head: list[bytes], rest: Iterable[bytes], size: int) -> Iterator[list[bytes]]:
    chunk = list(head)
    for raw in rest:
        chunk.append(raw)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _batch_model(
    catalog: dict[str, ModelSpec], versions: LiveVersions, model: str, line: int, endpoint: str
) -> ModelSpec:
    """The model a batch's first request names, or the line's error."""
    try:
        spec, version = resolve_model(catalog, model, None, versions)
    except ApiError as exc:
        code = "model_not_found" if isinstance(exc, UnknownModel) else "invalid_request"
        raise backfills.LineError(line, f"body.{exc.message}", code=code) from None
    if version is not None:
        raise backfills.LineError(
            line,
            f"body.model: a batch runs on the model's active version; name it without @{version}",
        )
    problem = openai_batches.model_problem(endpoint, spec)
    if problem:
        raise backfills.LineError(line, f"body.model: {problem}")
    return spec


def _error(exc: backfills.LineError) -> dict[str, Any]:
    found = _PARAM.match(exc.message)
    return {
        "code": exc.code,
        "message": exc.message,
        "param": found.group(1) if found else None,
        "line": exc.line,
    }


def _failed(sessions: sessionmaker[Session], batch: OpenAIBatch, exc: backfills.LineError) -> str:
    batch.errors = [_error(exc)]
    batch.failed_at = utcnow()
    with sessions.begin() as session:
        session.add(batch)
    return batch.id


def _record_errors(
    sessions: sessionmaker[Session], batch_id: str, exc: backfills.LineError
) -> None:
    with sessions.begin() as session:
        session.execute(
            update(OpenAIBatch).where(OpenAIBatch.id == batch_id).values(errors=[_error(exc)])
        )


def _abandon(sessions: sessionmaker[Session], ingest: backfills.Ingest, batch_id: str) -> None:
    """The request was refused, not the file: no batch stays."""
    ingest.abort()
    with sessions.begin() as session:
        session.execute(delete(OpenAIBatch).where(OpenAIBatch.id == batch_id))


def get_batch(session: Session, key: ApiKey, batch_id: str) -> OpenAIBatch:
    found = session.get(OpenAIBatch, batch_id)
    if found is None or found.api_key_id != key.id:
        raise ApiError(404, "not_found", f"no batch {batch_id!r}")
    return found


def batch_object(sessions: sessionmaker[Session], key: ApiKey, batch_id: str) -> dict[str, Any]:
    """The key's batch (or a 404) as :func:`batch_view` shows it."""
    with sessions() as session:
        batch = get_batch(session, key, batch_id)
    return batch_view(sessions, batch)


def batch_view(sessions: sessionmaker[Session], batch: OpenAIBatch) -> dict[str, Any]:
    """OpenAI's batch object, as it is now. A finished batch gets its output and error
    files the first time it is read (their lines are rendered from its jobs)."""
    backfill = None
    files: dict[str, str] = {}
    tokens = None
    made = 0
    with sessions() as session:
        if batch.backfill_id is not None:
            backfill = session.get(Backfill, batch.backfill_id)
        if backfill is not None and backfill.status in BACKFILL_DONE and backfill.total > 0:
            files = _result_files(sessions, session, batch, backfill)
            if batch.endpoint in openai_batches.GENERATION_PATHS:
                tokens, made = openai_batches.generation_tokens(sessions, backfill.id)
            else:
                tokens = openai_batches.input_tokens(session, backfill.id)
    return openai_batches.batch_object(batch, backfill, files, tokens, made)


def _result_files(
    sessions: sessionmaker[Session], session: Session, batch: OpenAIBatch, backfill: Backfill
) -> dict[str, str]:
    wanted = {
        OUTPUT: backfill.completed > 0,
        ERROR: backfill.failed + backfill.expired + backfill.cancelled > 0,
    }
    files = {
        str(role): file_id
        for role, file_id in session.execute(
            select(StoredFile.role, StoredFile.id).where(StoredFile.batch_id == batch.id)
        )
    }
    for role, needed in wanted.items():
        if not needed or role in files:
            continue
        try:
            files[role] = _file_to_come(
                sessions,
                batch.api_key_id,
                "batch_output",
                f"{batch.id}_{role}.jsonl",
                batch_id=batch.id,
                role=role,
            )
        except IntegrityError:
            # Another read made it first: use that one.
            with sessions() as reading:
                files[role] = reading.scalars(
                    select(StoredFile.id).where(
                        StoredFile.batch_id == batch.id, StoredFile.role == role
                    )
                ).one()
    return files


def list_batches(
    sessions: sessionmaker[Session], key: ApiKey, limit: int, after: str | None
) -> dict[str, Any]:
    with sessions() as session:
        query = select(OpenAIBatch).where(OpenAIBatch.api_key_id == key.id)
        rows = _page(session, query, OpenAIBatch, key.id, after, limit, ascending=False)
    return _list([batch_view(sessions, row) for row in rows[:limit]], len(rows) > limit)


def cancel_batch(sessions: sessionmaker[Session], key: ApiKey, batch_id: str) -> dict[str, Any]:
    """Stop the batch: lines not started are cancelled, running ones finish."""
    with sessions() as session:
        batch = get_batch(session, key, batch_id)
        if batch.backfill_id is None:
            raise ApiError(409, "conflict", f"batch {batch.id} failed; it cannot be cancelled")
        backfill = session.get(Backfill, batch.backfill_id)
        if backfill is not None and backfill.status == "expiring":
            # Its window has ended: what has not run is being expired already.
            return batch_view(sessions, batch)
        try:
            backfill_services.cancel(session, key, batch.backfill_id)
        except ApiError as exc:
            if exc.status != 409:
                raise
            status = openai_batches.batch_object(
                batch, session.get(Backfill, batch.backfill_id), {}
            )
            raise ApiError(
                409, "conflict", f"batch {batch.id} is {status['status']}; it cannot be cancelled"
            ) from None
    return batch_view(sessions, batch)
