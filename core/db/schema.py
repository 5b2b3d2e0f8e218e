"""The database schema (jobs, API keys, webhook deliveries) and how to open it.

The tables are created by the Alembic migrations in ``migrations/``, never by
``create_all``; this module only describes them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    event,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from core.config.settings import DB_POOL_OVERFLOW, DB_POOL_SIZE

TERMINAL_STATUSES = ("succeeded", "failed", "expired", "cancelled")
# A backfill's item is a job that waits (status "waiting", in no stream) until
# the feeder queues it in its model's bulk lane.
WAITING = "waiting"
# "expiring": its completion window ended; what has not run is being expired.
BACKFILL_ACTIVE = ("in_progress", "cancelling", "expiring")
BACKFILL_DONE = ("completed", "failed", "cancelled", "expired")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    salt: Mapped[str] = mapped_column(String(64))
    secret_hash: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # client: its own jobs, backfills and secret. admin: also the operator endpoints.
    scope: Mapped[str] = mapped_column(String(16), default="client", server_default="client")
    # The Standard Webhooks signing secret (whsec_...). Kept retrievable, not
    # hashed: Ferry must sign with it. After a rotation the previous secret
    # also signs until previous_webhook_secret_until, so receivers can switch.
    webhook_secret: Mapped[str | None] = mapped_column(String(100), nullable=True)
    previous_webhook_secret: Mapped[str | None] = mapped_column(String(100), nullable=True)
    previous_webhook_secret_until: Mapped[dt.datetime | None] = mapped_column(
        UTCDateTime(), nullable=True
    )
    # The lane of this key's OpenAI-compatible embeddings when the request names
    # none (OpenAI's request has no field for it); None: normal.
    embeddings_lane: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # Its share of a generation engine against other keys' (scheduler.generation's rule 4).
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")


def _partial_unique(name: str, first: str, second: str, over: str) -> Index:
    """Unique (``first``, ``second``) over the rows whose ``over`` is set (a row with a
    NULL in either column never conflicts: the rows left out are of those). A query
    whose WHERE tests ``over`` with ``=`` or ``>`` can use it, PostgreSQL knowing that
    they are never true of a NULL."""
    where = text(f"{over} IS NOT NULL")
    return Index(name, first, second, unique=True, postgresql_where=where, sqlite_where=where)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    # The key that authenticated the request; not a foreign key on PostgreSQL, whose
    # row-by-row check locked the key's row for every job inserted (migration 0014). Keys
    # are never deleted.
    api_key_id: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(64))
    # The version the job asked for (None: the model's active one), and the
    # version of the worker that last ran it.
    requested_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    model_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    priority: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    input: Mapped[Any] = mapped_column(JSON)
    cost: Mapped[int] = mapped_column(Integer)
    output: Mapped[Any | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    deadline_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    batch_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    batch_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    inference_ms: Mapped[float | None] = mapped_column(nullable=True)
    callback_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The webhook events it asked for, comma-separated (core.db.webhooks.JOB_EVENTS); None:
    # the terminal one only.
    callback_events: Mapped[str | None] = mapped_column(String(32), nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    metadata_: Mapped[Any | None] = mapped_column("metadata", JSON, nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Set for a backfill's items: which backfill, its line (from 1), its custom_id.
    backfill_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    line_no: Mapped[int | None] = mapped_column(Integer, nullable=True)
    custom_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The W3C traceparent of the request that made it (tracing on): the worker's
    # spans and the webhook delivery's continue that trace.
    trace_context: Mapped[str | None] = mapped_column(String(64), nullable=True)

    __table_args__ = (
        # A row enters an index at its insert and again at each update that changes an
        # indexed column (the claim and the outcome change the status): a plain job's
        # enters three, the two below and the primary key's. The unique ones hold only
        # the rows they constrain (NULLs never conflict), so they are partial.
        Index("ix_jobs_key_created", "api_key_id", "created_at"),
        # Outstanding jobs (the reconciler; the quota counter's rebuild) and the retention.
        Index("ix_jobs_status_finished", "status", "finished_at"),
        _partial_unique(
            "ux_jobs_key_idempotency", "api_key_id", "idempotency_key", over="idempotency_key"
        ),
        _partial_unique("ux_jobs_backfill_line", "backfill_id", "line_no", over="backfill_id"),
        _partial_unique(
            "ux_jobs_backfill_custom_id", "backfill_id", "custom_id", over="backfill_id"
        ),
    )


class KeyUsage(Base):
    """A key's jobs queued or running (backfill items not counted), for its quota.

    Moved in the same transaction as the rows it counts: up when jobs are
    inserted, down at their terminal write (``core.db.usage``), so the quota
    costs no count per submission however long the key's history.
    """

    __tablename__ = "key_usage"

    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), primary_key=True)
    outstanding: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ModelActivation(Base):
    """The version of a model an operator made active (ferry models activate).

    Without a row, the model's model.toml decides (``active_version``, or the
    highest version). Workers poll it and switch to the version it names.
    """

    __tablename__ = "model_activations"

    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ModelUnload(Base):
    """A model an operator unloaded (the inference protocol's repository unload).

    It takes no new jobs until it is loaded again; jobs accepted before run as
    ever. Which version is active is ``model_activations``' concern, untouched.
    """

    __tablename__ = "model_unloads"

    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    unloaded_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Backfill(Base):
    """A dataset run through a model: one job per input line, fed into the bulk lane."""

    __tablename__ = "backfills"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(64))
    # validating -> in_progress -> finalizing -> completed | failed;
    # in_progress -> cancelling -> cancelled; in_progress -> expiring -> expired
    status: Mapped[str] = mapped_column(String(16), default="validating")
    callback_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    # Kept with every terminal write of its jobs, in the same transaction.
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    expired: Mapped[int] = mapped_column(Integer, default=0)
    cancelled: Mapped[int] = mapped_column(Integer, default=0)
    # The feeder has queued every line up to this one.
    fed_through: Mapped[int] = mapped_column(Integer, default=0)
    input_bytes: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    in_progress_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finalizing_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancelling_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # When given (an OpenAI batch's completion window), lines that have not run
    # by then are expired and the backfill ends as "expired".
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Touched by every stored chunk of the upload: a "validating" backfill
    # left untouched for long was cut off (the API stopped) and is swept.
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (
        Index("ix_backfills_key_created", "api_key_id", "created_at"),
        Index("ix_backfills_status", "status"),
    )

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.expired + self.cancelled


class StoredFile(Base):
    """A file of the OpenAI-compatible Files API.

    An uploaded batch input keeps its bytes in ``file_parts``. A batch's output
    and error files keep none: their lines are rendered from the backfill's
    jobs when read (``api.batches.lines``), so results are stored once.
    """

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    # batch (an upload) or batch_output (a batch's output or error file).
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    # An output file's size is known once rendered: None until then.
    bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # For batch_output: the batch it belongs to, and which of its files (output, error).
    batch_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    deleted_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    __table_args__ = (
        UniqueConstraint("batch_id", "role", name="uq_files_batch_role"),
        Index("ix_files_key_created", "api_key_id", "created_at"),
    )


class FilePart(Base):
    """A piece of an uploaded file, in order: no row holds more than one part of it."""

    __tablename__ = "file_parts"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id"), primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class OpenAIBatch(Base):
    """A batch of the OpenAI-compatible Batch API: a backfill with OpenAI's bookkeeping.

    The backfill runs the lines (bulk lane, resumable, exact counts); this row
    keeps what OpenAI's batch object has besides. A batch whose file was
    refused before any line was stored has no backfill and holds the errors.
    """

    __tablename__ = "openai_batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    backfill_id: Mapped[str | None] = mapped_column(String(36), nullable=True, unique=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    model: Mapped[str | None] = mapped_column(String(64), nullable=True)
    metadata_: Mapped[Any | None] = mapped_column("metadata", JSON, nullable=True)
    # OpenAI's errors.data: [{"code", "message", "param", "line"}] when the file was refused.
    errors: Mapped[Any | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    failed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    __table_args__ = (Index("ix_openai_batches_key_created", "api_key_id", "created_at"),)


DELIVERY_OPEN = ("pending", "retrying", "delivering")
DELIVERY_DONE = ("delivered", "failed")


class WebhookDelivery(Base):
    """One event for one callback URL, delivered at least once.

    ``id`` is the ``webhook-id`` header: the same on every attempt and on a
    redelivery, so receivers can de-duplicate. ``payload`` holds the exact body
    sent, frozen when the event happened. The retry schedule lives here
    (``next_attempt_at``, ``step``), never in a Celery countdown.
    """

    __tablename__ = "webhook_deliveries"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    job_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    backfill_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    event_type: Mapped[str] = mapped_column(String(40))
    # 0, but for a job's job.started (the attempt) and job.progress (its tokens so far).
    ordinal: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    url: Mapped[str] = mapped_column(Text)
    payload: Mapped[str] = mapped_column(Text)
    # pending -> delivering -> delivered | retrying -> delivering ... | failed
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer, default=0)  # position in the retry schedule
    next_attempt_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # A dispatched delivery is not dispatched again before this (its task is queued).
    queued_until: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # An attempt in flight owns the delivery until this; past it, it is retried.
    lease_until: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    __table_args__ = (
        # One terminal delivery a job (ordinal 0); a started one an attempt, a progress one
        # a token count (the ordinal).
        UniqueConstraint("job_id", "event_type", "ordinal", name="uq_deliveries_job_event"),
        UniqueConstraint("backfill_id", "event_type", name="uq_deliveries_backfill_event"),
        Index("ix_deliveries_status_next", "status", "next_attempt_at"),
    )


class WebhookAttempt(Base):
    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    duration_ms: Mapped[float | None] = mapped_column(nullable=True)  # None: abandoned
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


# Ferry's transactions run their statements back to back, so a PostgreSQL session
# idle inside one for this long belongs to a process that stopped there (SIGSTOP, a
# paused VM, a stall). The server then ends it, and the row locks it held (a key's
# outstanding count, the jobs it was writing) stop blocking every other worker and
# the API; the stopped process, resumed, finds its connection gone and retries.
IDLE_IN_TRANSACTION_S = 10


# A PostgreSQL host that stops answering: a new connection is given up after
# CONNECT_TIMEOUT_S, one in use once what it sent stays unacknowledged for
# SILENT_HOST_TIMEOUT_S (make_engine says why).
CONNECT_TIMEOUT_S = 5
SILENT_HOST_TIMEOUT_S = 10
# A pooled connection is closed and replaced after this long.
POOL_RECYCLE_S = 1800
# libpq's parameters for every PostgreSQL connection Ferry opens (make_engine says why).
PG_CONNECT_ARGS: dict[str, Any] = {
    "connect_timeout": CONNECT_TIMEOUT_S,
    "tcp_user_timeout": SILENT_HOST_TIMEOUT_S * 1000,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}


def make_engine(
    url: str, pool_size: int = DB_POOL_SIZE, overflow: int = DB_POOL_OVERFLOW
) -> Engine:
    """An engine tuned for Ferry's many short transactions from several processes; its pool
    keeps ``pool_size`` connections and opens up to ``overflow`` more in a burst."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"timeout": 30, "check_same_thread": False},
            pool_size=pool_size,
            max_overflow=overflow,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            # WAL lets the API read while a worker writes; busy_timeout makes
            # concurrent writers from several processes wait instead of failing.
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    # A database host that stops answering must not hold a worker or a request
    # for the kernel's TCP timeout (minutes): give up on a new connection in 5 s,
    # and on one in use whose host went silent (a cut link, a host that died
    # without closing it) once what was sent stays unacknowledged for 10 s, or
    # the idle peer misses three keepalives. A slow but live server acknowledges
    # and answers keepalives from its kernel: long statements are not cut.
    connect_args: dict[str, Any] = PG_CONNECT_ARGS if url.startswith("postgresql") else {}
    # No ping before each checkout (a round trip per transaction): a connection
    # found dead when used fails that one transaction with a disconnect error,
    # and SQLAlchemy then drops every pooled connection, so the next ones are
    # new. psycopg prepares a statement the fifth time a connection runs it.
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=overflow,
        pool_recycle=POOL_RECYCLE_S,
        connect_args=connect_args,
    )
    if url.startswith("postgresql"):

        @event.listens_for(engine, "connect")
        def _session_settings(dbapi_connection: Any, _record: Any) -> None:
            # A SET, not the startup "options" parameter, which PgBouncer refuses.
            cursor = dbapi_connection.cursor()
            cursor.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_S}s'")
            cursor.close()
            dbapi_connection.commit()

    return engine


def read_only(engine: Engine) -> Engine:
    """The engine's pool without transactions: each read is one statement, no BEGIN/ROLLBACK."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def make_sessionmaker(engine: Engine) -> sessionmaker[Any]:
    return sessionmaker(bind=engine, expire_on_commit=False)


@dataclass(frozen=True)
class DatabaseSettings:
    """A process's database and its pool (``Settings.section``: FERRY_DATABASE_URL, or
    SQLite in the data folder; FERRY_DB_POOL_SIZE, FERRY_DB_POOL_OVERFLOW)."""

    sqlalchemy_url: str
    db_pool_size: int
    db_pool_overflow: int


def engine_for(database: DatabaseSettings) -> Engine:
    """``make_engine`` for the database, with its pool sizes."""
    return make_engine(database.sqlalchemy_url, database.db_pool_size, database.db_pool_overflow)
