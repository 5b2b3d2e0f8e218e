"""What an API process holds for its requests: one typed object, made by the app's lifespan.

Routes, dependencies and services read it with :func:`app_state` (from the
request, or the app), never by name from Starlette's untyped ``app.state``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import HTTPConnection

if TYPE_CHECKING:
    import redis
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from api.completions import CompletionHub
    from api.jobs.reads import GroupRead, JobReader, LoopReader
    from api.jobs.submissions import GroupCommit
    from api.jobs.tails import StreamTails
    from api.keycache import KeyCache
    from api.limits import RequestLimits
    from backends.catalog import LiveVersions
    from core.db.webhooks import DeliveryKicker
    from core.models.catalog import ModelSpec
    from core.ops.metrics import Scalers
    from core.streams.target import RedisTarget, ServerClock

# Where the lifespan puts it on Starlette's ``app.state``.
_NAME = "ferry"


@dataclass(frozen=True)
class ApiSettings:
    """What the API's routes and services read of the settings (``Settings.section``):
    the key prefix, what a request may ask for and send, and where models are."""

    key_prefix: str
    max_wait_s: float
    max_body_bytes: int
    max_metadata_bytes: int
    max_json_depth: int
    embeddings_max_inputs: int
    backfill_max_bytes: int
    backfill_max_lines: int
    max_outstanding_backfill_lines: int
    max_outstanding_jobs: int
    webhook_secret_grace_s: float
    model_repository_path: Path
    metrics_bearer: str | None


@dataclass
class AppState:
    """One API process's parts, each made once at startup and closed at shutdown.

    ``sessions`` writes (and reads what must be fresh); ``reads`` is the
    read-only pool of the same engine. ``versions``: the models' versions as
    the database says, followed every FERRY_MODEL_POLL_S. ``group_commit`` and
    ``group_read``: the process's batched database writes and reads; ``reader``,
    what does the reads.
    ``target``: where Redis is; ``redis``, the process's shared client;
    ``tails``: the process's readers of job events streams (one blocked XREAD a
    model for all of them).
    ``clock``: the Redis server's clock, jobs are stamped by.
    ``draining``: set at the first stop signal (``/readyz`` answers 503, long
    polls and event streams end).
    """

    settings: ApiSettings
    engine: Engine
    sessions: sessionmaker[Session]
    reads: sessionmaker[Session]
    keys: KeyCache
    scalers: Scalers
    catalog: dict[str, ModelSpec]
    versions: LiveVersions
    target: RedisTarget
    redis: redis.Redis
    hub: CompletionHub
    tails: StreamTails
    limits: RequestLimits
    clock: ServerClock
    group_read: GroupRead
    reader: JobReader | LoopReader
    group_commit: GroupCommit
    kick: DeliveryKicker
    check_callback: Callable[[str], None]
    draining: bool = False


def app_state(owner: Any) -> AppState:
    """The state of ``owner``'s app: ``owner`` is a request, or the app itself."""
    app = owner.app if isinstance(owner, HTTPConnection) else owner
    state = getattr(app.state, _NAME, None)
    if not isinstance(state, AppState):
        raise RuntimeError("the API's state is made by its lifespan: the app has not started")
    return state


def install(app: Any, state: AppState) -> None:
    """Put ``state`` on ``app`` (the lifespan, at startup)."""
    setattr(app.state, _NAME, state)


def mark_draining(app: Any) -> None:
    """A stop signal came: say so to every request (no-op before the app has started)."""
    state = getattr(app.state, _NAME, None)
    if isinstance(state, AppState):
        state.draining = True
