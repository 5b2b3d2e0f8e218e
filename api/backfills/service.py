"""What the backfill routes do: the streamed upload, reads, cancel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import redis
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from api.backfills.schemas import BackfillResource
from api.errors import ApiError
from api.owned import owned
from api.state import ApiSettings
from core.db import backfills
from core.db.schema import ApiKey, Backfill, utcnow
from core.models.catalog import ModelSpec
from core.streams.queues import live_workers, model_stats
from core.streams.target import REDIS_ERRORS

# Lines handed to the database at a time (each chunk is one transaction).
CHUNK_LINES = 2000


async def upload(
    body: AsyncIterator[bytes],
    sessions: sessionmaker[Session],
    key: ApiKey,
    spec: ModelSpec,
    callback_url: str | None,
    settings: ApiSettings,
) -> str:
    """Read the NDJSON body as it arrives and store it; returns the backfill's id.

    Never holds the file: at most one chunk of lines (and one line's bytes) at
    a time. Any refusal deletes what was stored of it.
    """
    room = await run_in_threadpool(
        backfill_room, sessions, key, settings.max_outstanding_backfill_lines
    )
    backfill_id = await run_in_threadpool(
        backfills.start, sessions, key.id, spec.name, callback_url
    )
    max_lines = min(settings.backfill_max_lines, room)
    ingest = backfills.Ingest(
        sessions, backfill_id, key.id, spec, max_lines, settings.max_json_depth
    )
    try:
        lines: list[bytes] = []
        rest = b""
        size = 0
        async for data in body:
            size += len(data)
            if size > settings.backfill_max_bytes:
                raise backfills.LineError(
                    ingest.line + len(lines) + 1,
                    f"the file is larger than {settings.backfill_max_bytes} bytes",
                    status=413,
                )
            parts = (rest + data).split(b"\n")
            rest = parts.pop()
            if len(rest) > settings.max_body_bytes:
                raise backfills.LineError(
                    ingest.line + len(lines) + len(parts) + 1,
                    f"longer than {settings.max_body_bytes} bytes",
                    status=413,
                )
            lines += parts
            if len(lines) >= CHUNK_LINES:
                await run_in_threadpool(ingest.add, lines)
                lines = []
        if rest:
            lines.append(rest)
        await run_in_threadpool(ingest.add, lines)
        await run_in_threadpool(ingest.finish, settings.max_outstanding_backfill_lines)
    except backfills.QuotaExceeded as exc:
        # Uploads that finished meanwhile took the room this one counted on.
        await run_in_threadpool(ingest.abort)
        raise quota_error(settings.max_outstanding_backfill_lines, exc.room) from None
    except backfills.LineError as exc:
        await run_in_threadpool(ingest.abort)
        if exc.status == 413 and max_lines < settings.backfill_max_lines and ingest.over_lines:
            raise quota_error(settings.max_outstanding_backfill_lines, room) from None
        kind = "payload_too_large" if exc.status == 413 else "invalid_request"
        raise ApiError(exc.status, kind, str(exc), line=exc.line) from None
    except BaseException:
        await run_in_threadpool(ingest.abort)  # a client that went away, or a failure
        raise
    return backfill_id


def backfill_room(sessions: sessionmaker[Session], key: ApiKey, limit: int) -> int:
    """Lines this key may still upload: its limit less the lines of its unfinished backfills."""
    with sessions() as session:
        room = limit - backfills.outstanding_lines(session, key.id)
    if room <= 0:
        raise quota_error(limit, 0)
    return room


def quota_error(limit: int, room: int) -> ApiError:
    return ApiError(
        429,
        "quota_exceeded",
        f"backfill lines outstanding: this key may have {limit} unfinished backfill lines "
        f"(FERRY_MAX_OUTSTANDING_BACKFILL_LINES) and has room for {room}; "
        "upload more as its backfills finish",
        {"Retry-After": "60"},
    )


def get_backfill(session: Session, key: ApiKey, backfill_id: str) -> Backfill:
    return owned(session, Backfill, key, backfill_id, "backfill")


def cancel(session: Session, key: ApiKey, backfill_id: str) -> Backfill:
    """Stop feeding; the feeder cancels what has not started and finishes it."""
    backfill = get_backfill(session, key, backfill_id)
    result = session.execute(
        update(Backfill)
        .where(Backfill.id == backfill.id, Backfill.status == "in_progress")
        .values(status="cancelling", cancelling_at=utcnow())
    )
    session.commit()
    session.refresh(backfill)
    if not result.rowcount and backfill.status not in ("cancelling", "cancelled"):  # type: ignore[attr-defined]
        raise ApiError(
            409, "conflict", f"backfill {backfill.id} is {backfill.status}; it cannot be cancelled"
        )
    return backfill


def list_backfills(session: Session, key: ApiKey, limit: int) -> list[Backfill]:
    return list(
        session.scalars(
            select(Backfill)
            .where(Backfill.api_key_id == key.id)
            .order_by(Backfill.created_at.desc())
            .limit(limit)
        )
    )


def to_resource(
    backfill: Backfill, rate: Callable[[str], float | None] | None = None
) -> BackfillResource:
    fallback = rate(backfill.model) if rate is not None and backfill.done == 0 else None
    eta = backfills.eta_s(backfill, utcnow(), fallback)
    return BackfillResource.model_validate(backfills.backfill_resource(backfill, eta))


def learned_rate(client: redis.Redis, prefix: str) -> Callable[[str], float | None]:
    """Jobs per second a model's workers get through, from what they published."""

    def rate(model: str) -> float | None:
        try:
            stats = model_stats(client, prefix, model)
            workers = live_workers(client, prefix, model)
        except REDIS_ERRORS:
            return None
        size, batch_ms = stats.get("avg_batch_size"), stats.get("avg_batch_ms")
        if not size or not batch_ms or not workers:
            return None
        return size / (batch_ms / 1000.0) * workers

    return rate
