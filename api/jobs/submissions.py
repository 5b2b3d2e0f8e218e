"""Submissions, written in groups: one transaction and one Redis round trip for many jobs.

A request is validated on its own (:func:`prepare`), then waits in the
process's group commit (``api.groups.GroupStage``) for the submissions that
arrive with it. Each group is written by :class:`GroupWriter` in one thread
hop: on PostgreSQL one statement, its own transaction (``api.jobs.at_once``); on
SQLite the idempotency keys looked up in one query, the keys' outstanding-jobs
counters moved (``core.db.usage``), one multi-row INSERT and one COMMIT. Then the
group's stream entries go to Redis in one pipeline, and only then is each request
answered.
A 202 still means the job is committed (docs/architecture.md §4).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import redis
from pydantic import ValidationError
from redis.exceptions import OutOfMemoryError
from sqlalchemy import Engine, Table, delete, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from api.breaker import SHED, Breaker, Load
from api.errors import ApiError, validation_text
from api.groups import GroupStage
from api.jobs import at_once
from api.jobs.schemas import JobCreate, metadata_problem
from api.models.service import resolve_model
from api.state import AppState, app_state
from backends.catalog import LiveVersions
from core.db.schema import ApiKey, Job, KeyUsage, read_only, utcnow
from core.db.usage import release, release_jobs, reserve
from core.models.catalog import InputError, ModelSpec, nesting_problem
from core.models.estimates import ModelEstimate, estimate_wait_s, jobs_ahead
from core.models.generation_estimates import (
    GenerationEstimate,
    finish_s,
    first_token_s,
    most_tokens_within,
)
from core.ops import tracing
from core.ops.metrics import JOBS_REFUSED
from core.streams.bounds import QueueBound, retry_after_s
from core.streams.protocol import JobMessage, Scripts
from core.streams.queues import live_workers, numeric_stats, queued_bytes, stats_text, tenant_depths
from core.streams.target import REDIS_ERRORS
from scheduler.vocabulary import LANES

log = logging.getLogger(__name__)

QUOTA_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Submission:
    """A request checked on its own, ready to be written with its group."""

    key: ApiKey
    spec: ModelSpec
    requested_version: int | None
    body: JobCreate
    input: Any
    cost: int
    idempotency_key: str | None
    request_id: str | None
    received_at: dt.datetime
    trace_context: str | None = None  # the request's traceparent, when tracing is on
    input_bytes: int = 0  # the input's size as stored (its JSON), for FERRY_QUEUE_MAX_BYTES


@dataclass(frozen=True)
class Submitted:
    job: Job
    replayed: bool
    estimated_wait_ms: float | None
    max_tokens: int | None = None  # a generation job's max_tokens, cut to meet its deadline


@dataclass(frozen=True)
class Quote:
    """What a new job is told on its 202: the wait, and a max_tokens cut to its deadline."""

    wait_ms: float | None
    max_tokens: int | None = None


Outcome = Submitted | ApiError
# The process's group commit: a submission in, the job committed and enqueued out.
GroupCommit = GroupStage[Submission, Submitted]


def prepare(
    catalog: dict[str, ModelSpec],
    key: ApiKey,
    body: JobCreate,
    idempotency_key: str | None,
    request_id: str | None,
    *,
    max_metadata_bytes: int,
    max_json_depth: int,
    live: LiveVersions | None,
    resolve: Callable[..., tuple[ModelSpec, int | None]],
    trace_context: str | None = None,
    received_at: dt.datetime | None = None,
) -> Submission:
    """Everything about one submission that needs neither the database nor Redis;
    ``received_at``: when it came (None: now by this host's clock)."""
    spec, requested_version = resolve(catalog, body.model, body.version, live)
    for name, value in (("input", body.input), ("metadata", body.metadata)):
        problem = nesting_problem(value, max_json_depth)
        if problem:
            raise ApiError(422, "invalid_request", f"{name}: must not contain {problem}")
    problem = metadata_problem(body.metadata, max_metadata_bytes)
    if problem:
        raise ApiError(422, "invalid_request", f"metadata: {problem}")
    try:
        validated = spec.validate(body.input)
    except InputError as exc:
        raise ApiError(422, "invalid_request", f"{exc.field}: {exc.message}") from exc
    if body.on_deadline == "truncate" and _generation_tokens(validated.input) is None:
        raise ApiError(
            422, "invalid_request", "on_deadline: truncate applies to generation jobs only"
        )
    if body.callback_events and _generation_tokens(validated.input) is None:
        asked = [event for event in body.callback_events if event != "terminal"]
        if asked:
            raise ApiError(
                422,
                "invalid_request",
                f"callback_events: {' and '.join(asked)} apply to generation jobs only "
                f"({spec.name}'s jobs send their terminal event only)",
            )
    if body.idempotency_key and idempotency_key and body.idempotency_key != idempotency_key:
        raise ApiError(
            422, "invalid_request", "idempotency_key: differs from the Idempotency-Key header"
        )
    return Submission(
        key=key,
        spec=spec,
        requested_version=requested_version,
        body=body,
        input=validated.input,
        cost=validated.cost,
        idempotency_key=body.idempotency_key or idempotency_key,
        request_id=request_id,
        received_at=received_at or utcnow(),
        trace_context=trace_context,
        input_bytes=input_size(validated.input),
    )


def withdraw(state: AppState, key_id: str, job_ids: Sequence[str]) -> list[str]:
    """Take back jobs of key ``key_id`` this process has just admitted, for a request
    refused whole: those still queued are deleted (uncounted from the key's quota, their
    idempotency keys free again, their stream entries dropped by the worker that finds no
    row); returns the ids of those a worker took meanwhile, which are the caller's to
    cancel."""
    if not job_ids:
        return []
    with state.sessions() as session:
        # The key's counter first, as a group's insert takes it (then its rows): the two
        # never wait for each other's locks in opposite orders.
        session.execute(
            select(KeyUsage.api_key_id).where(KeyUsage.api_key_id == key_id).with_for_update()
        )
        rows = session.execute(
            delete(Job)
            .where(Job.id.in_(list(job_ids)), Job.status == "queued")
            .returning(Job.id, Job.api_key_id, Job.backfill_id)
        ).all()
        counts: dict[str, int] = {}
        for row in rows:
            if row.backfill_id is None:
                counts[row.api_key_id] = counts.get(row.api_key_id, 0) + 1
        release(session, counts)
        session.commit()
    deleted = {row.id for row in rows}
    state.hub.ended(deleted)
    return [id for id in job_ids if id not in deleted]


def input_size(value: Any) -> int:
    """An input's bytes as the jobs table stores it (compact JSON, UTF-8)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    return len(text.encode("utf-8", "surrogatepass"))


def job_create(**fields: Any) -> JobCreate:
    """A job a route builds from another API's request (OpenAI's, the inference protocol's):
    what its schema refuses (a NUL in a text, a deadline past the longest) is a 422 naming
    the field, as for a body sent to POST /v1/jobs, never a 500."""
    try:
        return JobCreate(**fields)
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", validation_text(exc.errors())) from None


def prepare_request(
    request: Any, key: ApiKey, body: JobCreate, idempotency_key: str | None
) -> Submission:
    """:func:`prepare` with the app's catalog, live versions and limits, as every route needs."""
    return prepare_in(app_state(request), key, body, idempotency_key, request.state.request_id)


def prepare_in(
    state: AppState, key: ApiKey, body: JobCreate, idempotency_key: str | None, request_id: str
) -> Submission:
    """:func:`prepare` with ``state``'s catalog, live versions and limits (a request's, or
    the gRPC service's, which has no HTTP request)."""
    settings = state.settings
    return prepare(
        state.catalog,
        key,
        body,
        idempotency_key,
        request_id,
        max_metadata_bytes=settings.max_metadata_bytes,
        max_json_depth=settings.max_json_depth,
        live=state.versions,
        resolve=resolve_model,
        trace_context=tracing.traceparent(),
        received_at=dt.datetime.fromtimestamp(state.clock.cached(), dt.UTC),
    )


# The statuses of a new job refused for the state of its model or its key (counted by why).
REFUSALS = frozenset({413, 429, 503})

# What a model's queue looks like is read at most once per VIEW_TTL_S per API
# process and model, not at every submission.
VIEW_TTL_S = 0.25


@dataclass
class QueueView:
    estimate: ModelEstimate | None  # None: no worker has published yet
    depths: dict[str, dict[str, int]]
    workers: int
    generation: GenerationEstimate | None = None  # what a generation model's workers publish
    queued_bytes: int = 0  # the input bytes of the model's stream entries
    load: Load | None = None  # what the circuit breaker reads (api/breaker.py)

    @property
    def jobs(self) -> int:
        """The model's jobs queued or held by a worker, not yet recorded."""
        return sum(sum(by_tenant.values()) for by_tenant in self.depths.values())

    def drain_s(self, jobs: int) -> float | None:
        """Seconds until ``jobs`` of the jobs queued have finished, from what the workers
        learned (as if one worker were live when none is); None before any has published."""
        ahead = max(jobs - 1, 0)
        if self.generation is not None:
            est = self.generation
            return finish_s(
                est,
                ahead,
                max(1, round(est.mean_prompt_tokens)),
                max(1, round(est.mean_max_tokens)),
                self.workers,
            )
        if self.estimate is not None:
            cost = max(1, round(self.estimate.mean_cost))
            return estimate_wait_s(self.estimate, ahead, cost, self.workers)
        return None

    def wait_ms(
        self, lane: str, tenant: str, cost: int, tokens: tuple[int, int] | None = None
    ) -> float | None:
        """Milliseconds until the job finishes; for a generation job (``tokens``: its
        prompt_tokens and max_tokens), until its first token."""
        if self.generation is not None and tokens is not None:
            ahead = jobs_ahead(self.depths, lane, tenant)
            wait_s = first_token_s(self.generation, ahead, *tokens, self.workers)
            return round(wait_s * 1000.0, 1)
        if self.estimate is None:
            return None
        ahead = jobs_ahead(self.depths, lane, tenant)
        return round(estimate_wait_s(self.estimate, ahead, cost, self.workers) * 1000.0, 1)

    def finish_ms(self, lane: str, tenant: str, tokens: tuple[int, int]) -> float | None:
        """Milliseconds until a generation job ends, were it to run to its max_tokens."""
        if self.generation is None:
            return None
        ahead = jobs_ahead(self.depths, lane, tenant)
        return round(finish_s(self.generation, ahead, *tokens, self.workers) * 1000.0, 1)

    def most_tokens_within(
        self, lane: str, tenant: str, tokens: tuple[int, int], deadline_ms: float
    ) -> int:
        """The largest max_tokens with which a generation job is predicted to meet its deadline
        (0: none)."""
        if self.generation is None:
            return tokens[1]
        ahead = jobs_ahead(self.depths, lane, tenant)
        return most_tokens_within(
            self.generation, ahead, *tokens, deadline_ms / 1000.0, self.workers
        )

    def add(self, lane: str, tenant: str, input_bytes: int = 0) -> None:
        """Count a job this process is queueing, until the view is read again: a burst's
        later jobs see its earlier ones ahead of them, and the queue's bounds count it."""
        by_tenant = self.depths.setdefault(lane, {})
        by_tenant[tenant] = by_tenant.get(tenant, 0) + 1
        self.queued_bytes += input_bytes


class QueueViews:
    """Each model's learned numbers, queue depths and live workers, as of VIEW_TTL_S ago at
    most, plus the jobs this process has queued since."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        ttl_s: float = VIEW_TTL_S,
        bound: QueueBound | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.bound = bound or QueueBound()
        self._views: dict[str, tuple[float, QueueView | None]] = {}
        # The group commit's writers share the views (two threads on PostgreSQL).
        self.lock = threading.Lock()

    def get(self, model: str) -> QueueView | None:
        """None while Redis cannot be read (no estimate then, like before any worker)."""
        now = time.monotonic()
        cached = self._views.get(model)
        if cached is not None and now - cached[0] < self.ttl_s:
            return cached[1]
        view: QueueView | None
        try:
            raw = stats_text(self.client, self.prefix, model)
            stats = numeric_stats(raw)
            estimate = ModelEstimate.from_hash(stats)
            generation = GenerationEstimate.from_hash(raw)
            if estimate is None and generation is None and not self.bound.bounded:
                # No worker has published and nothing is bounded: spare the depth reads.
                view = QueueView(None, {lane: {} for lane in LANES}, 0)
            else:
                view = QueueView(
                    estimate,
                    tenant_depths(self.client, self.prefix, model),
                    live_workers(self.client, self.prefix, model),
                    generation,
                    queued_bytes(self.client, self.prefix, model) if self.bound.max_bytes else 0,
                    Load.from_stats(stats) if estimate is not None else None,
                )
        except REDIS_ERRORS:
            view = None
        self._views[model] = (now, view)
        return view


@dataclass(eq=False)
class GroupWriter:
    """Writes a group of submissions: one transaction, one Redis pipeline (a thread's work)."""

    sessions: sessionmaker[Session]
    client: redis.Redis
    prefix: str
    _: KW_ONLY
    max_outstanding: int | None
    requeue_within_s: float
    bound: QueueBound = field(default_factory=QueueBound)
    breaker: Breaker | None = None
    # Told each group's new jobs (id, key id) once written, before they are enqueued,
    # and the ids of those deleted again when Redis refused them (answered refused).
    accepted: Callable[[Iterable[tuple[str, str]]], None] | None = None
    taken_back: Callable[[Iterable[str]], None] | None = None

    def __post_init__(self) -> None:
        self.views = QueueViews(self.client, self.prefix, bound=self.bound)
        self.scripts = Scripts(self.client)
        # Until then (monotonic), Redis is taken to be at its maxmemory: refused unwritten.
        self.memory_full_until = 0.0
        # PostgreSQL: a group is written in one statement (api.jobs.at_once), in autocommit.
        engine = self.sessions.kw.get("bind")
        self.at_once = (
            read_only(engine)
            if isinstance(engine, Engine) and engine.dialect.name == "postgresql"
            else None
        )

    def write(self, group: Sequence[Submission]) -> list[Submitted | Exception]:
        outcomes: list[Outcome | None] = [None] * len(group)
        estimates: dict[int, Quote] = {}
        todo = list(range(len(group)))
        try:
            jobs = self._commit(group, todo, outcomes, estimates)
        except (IntegrityError, DataError):
            # One request's row broke the group's statement: write each alone,
            # so only that request fails.
            jobs = {}
            for i in todo:
                try:
                    jobs.update(self._commit(group, [i], outcomes, estimates))
                except SQLAlchemyError as exc:
                    outcomes[i] = _database_error(exc)
        except SQLAlchemyError as exc:
            for i in todo:
                outcomes[i] = _database_error(exc)
            return [_done(outcome) for outcome in outcomes]
        if self.accepted is not None and jobs:
            self.accepted([(job.id, job.api_key_id) for job in jobs.values()])
        self._enqueue(group, jobs, outcomes, estimates)
        for item, outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, ApiError) and outcome.status in REFUSALS:
                JOBS_REFUSED.labels(item.spec.name, item.body.priority, outcome.type).inc()
        return [_done(outcome) for outcome in outcomes]

    def _shed(self, item: Submission) -> ApiError | None:
        """A 503 for a new job of a lane its model's circuit breaker sheds now."""
        lane = item.body.priority
        if self.breaker is None or lane not in SHED[-1]:
            return None
        name = item.spec.name
        view = self.views.get(name)
        why = self.breaker.sheds(name, lane, view.load if view is not None else None)
        if why is None:
            return None
        wait = max(1, math.ceil(self.breaker.policy.cool_s))
        return ApiError(
            503,
            "overloaded",
            f"priority: {name} refuses new {lane} jobs while it is overloaded ({why}); retry "
            f"in about {wait} s",
            {"Retry-After": str(wait)},
            shed=lane,
        )

    def _full(self, item: Submission, taken: dict[str, tuple[int, int]]) -> ApiError | None:
        """A 503 for a new job its model's queue has no room for (``taken``: the jobs and
        bytes of this group already let in, by model, which the view does not count yet),
        or any while Redis was lately found at its maxmemory."""
        name = item.spec.name
        if time.monotonic() < self.memory_full_until:
            return self._memory_full(name)
        if not self.bound.bounded:
            return None
        if self.bound.never_fits(item.input_bytes):
            return ApiError(
                413,
                "payload_too_large",
                f"input: {item.input_bytes} bytes exceed the whole "
                f"of {name}'s queue (FERRY_QUEUE_MAX_BYTES, {self.bound.max_bytes} bytes)",
            )
        view = self.views.get(name)
        if view is None:
            return None  # Redis unreadable: the enqueue decides (the reconciler catches up)
        jobs, size = taken.get(name, (0, 0))
        with self.views.lock:
            bound = self.bound.for_lane(item.body.priority)
            excess = bound.excess(view.jobs + jobs, view.queued_bytes + size, item.input_bytes)
            drain = view.drain_s(excess.jobs_to_finish) if excess is not None else None
        if excess is None:
            taken[name] = (jobs + 1, size + item.input_bytes)
            return None
        wait = retry_after_s(drain)
        what = "jobs" if excess.setting == "FERRY_QUEUE_MAX_JOBS" else "bytes of input"
        return ApiError(
            503,
            "queue_full",
            f"model: {name}'s queue holds {excess.queued} {what}, its bound "
            f"({excess.setting}, {excess.limit}); retry in about {wait} s",
            {"Retry-After": str(wait)},
            bound=excess.setting,
            limit=excess.limit,
        )

    def _refusal(self, item: Submission, i: int, estimates: dict[int, Quote]) -> ApiError | None:
        """A 429 for a new job whose deadline the queue ahead makes impossible (a generation
        job asking for it: accepted instead with the max_tokens that can meet it)."""
        view = self.views.get(item.spec.name)
        tokens = _generation_tokens(item.input)
        deadline = item.body.deadline_ms
        priority, tenant = item.body.priority, item.key.id
        fit = None
        with self.views.lock:
            wait = view.wait_ms(priority, tenant, item.cost, tokens) if view else None
            # A generation's deadline bounds queue, prefill and every token.
            finish = view.finish_ms(priority, tenant, tokens) if view and tokens else wait
            if (
                view is not None
                and tokens is not None
                and deadline is not None
                and finish is not None
                and finish > deadline
                and item.body.on_deadline == "truncate"
            ):
                fit = view.most_tokens_within(priority, tenant, tokens, deadline)
        estimates[i] = Quote(wait)
        if deadline is None or finish is None or finish <= deadline:
            return None
        if fit:
            # The row stores what it runs with, and what was asked (a retry with the same
            # idempotency key asks the same, and must find this job).
            item.input[ASKED_MAX_TOKENS] = item.input.get(
                ASKED_MAX_TOKENS, item.input["max_tokens"]
            )
            item.input["max_tokens"] = fit
            estimates[i] = Quote(wait, fit)
            return None
        # Refuse now rather than accept a job that would only expire.
        how = " running to its max_tokens" if tokens is not None else ""
        return ApiError(
            429,
            "deadline_unattainable",
            f"deadline_ms: {deadline} ms cannot be met; with the queue ahead "
            f"this job would finish{how} in about {finish:.0f} ms",
            estimated_wait_ms=finish,
        )

    def _commit(
        self,
        group: Sequence[Submission],
        todo: list[int],
        outcomes: list[Outcome | None],
        estimates: dict[int, Quote],
    ) -> dict[int, Job]:
        """Insert the new jobs of ``todo`` in one transaction; replays and refusals go to
        ``outcomes``. Returns the committed jobs by their index in the group.

        A replay is answered whatever the queue and the quota now: only new
        jobs are held to their deadline and counted."""
        if self.at_once is not None:
            return self._commit_at_once(group, todo, outcomes, estimates)
        with self.sessions() as session:
            existing = self._existing(
                session, {_idem(group[i]) for i in todo if group[i].idempotency_key}
            )
            rest: list[int] = []
            for i in todo:
                found = existing.get(_idem(group[i])) if group[i].idempotency_key else None
                if found is not None:
                    outcomes[i] = _replay(found, group[i])
                else:
                    rest.append(i)
            fresh, repeats = _firsts(group, rest)
            refused = self._refusals(group, fresh, estimates)
            for i, why in refused.items():
                outcomes[i] = why
            fresh = [i for i in fresh if i not in refused]
            wanted: dict[str, int] = {}
            for i in fresh:
                wanted[group[i].key.id] = wanted.get(group[i].key.id, 0) + 1
            room = reserve(session, wanted, self.max_outstanding)
            jobs: dict[int, Job] = {}
            for i in fresh:
                key_id = group[i].key.id
                if room[key_id] > 0:
                    room[key_id] -= 1
                    jobs[i] = _new_job(group[i])
                    view = self.views.get(group[i].spec.name)
                    if view is not None:
                        with self.views.lock:
                            view.add(group[i].body.priority, key_id, group[i].input_bytes)
                else:
                    outcomes[i] = _quota_error(self.max_outstanding)
            inserted = self._insert(session, list(jobs.values()))
            raced: dict[str, int] = {}
            for i, job in list(jobs.items()):
                if job.id not in inserted:
                    # Another process committed the same idempotency key meanwhile.
                    del jobs[i]
                    raced[job.api_key_id] = raced.get(job.api_key_id, 0) + 1
                    found = self._existing(session, {_idem(group[i])}).get(_idem(group[i]))
                    outcomes[i] = _taken(found, group[i])
            release(session, raced)  # reserved, but replays after all
            session.commit()  # durable before anything is queued or answered
        _answer_repeats(group, repeats, jobs, outcomes)
        return jobs

    def _commit_at_once(
        self,
        group: Sequence[Submission],
        todo: list[int],
        outcomes: list[Outcome | None],
        estimates: dict[int, Quote],
    ) -> dict[int, Job]:
        """:meth:`_commit` on PostgreSQL: the new jobs and their keys' counters in one
        statement (``api.jobs.at_once``). An idempotency key is looked up only where its
        row was found taken, or before its request is refused (a replay is answered
        whatever the queue now)."""
        assert self.at_once is not None
        fresh, repeats = _firsts(group, todo)
        refused = self._refusals(group, fresh, estimates)
        self._replays_or(group, refused, outcomes)
        candidates = {i: _new_job(group[i]) for i in fresh if i not in refused}
        jobs: dict[int, Job] = {}
        with self.at_once.connect() as connection:
            # At most three statements: again for a key's first job (once its counter is
            # made), and for what a taken idempotency key's place left room for.
            for last in (False, False, True):
                order = list(candidates)
                written = at_once.write(
                    connection, [at_once.row_of(candidates[i]) for i in order], self.max_outstanding
                )
                for at in written.inserted:
                    jobs[order[at]] = candidates.pop(order[at])
                taken = [order[at] for at in written.conflicted]
                self._answer_taken(group, taken, outcomes)
                for i in taken:
                    del candidates[i]
                crowded = {group[i].key.id for i in taken}
                over = [order[at] for at in written.over_quota]
                over = [i for i in over if last or group[i].key.id not in crowded]
                quota = _quota_error(self.max_outstanding)
                self._replays_or(group, dict.fromkeys(over, quota), outcomes)
                for i in over:
                    del candidates[i]
                uncounted = [candidates[order[at]].api_key_id for at in written.uncounted]
                if uncounted and not last:
                    at_once.add_counters(connection, uncounted)
                if not candidates:
                    break
        for i in candidates:  # a key whose counter could not be made
            outcomes[i] = _unavailable()
        for i, job in jobs.items():
            view = self.views.get(job.model)
            if view is not None:
                with self.views.lock:
                    view.add(job.priority, job.api_key_id, group[i].input_bytes)
        _answer_repeats(group, repeats, jobs, outcomes)
        return jobs

    def _refusals(
        self, group: Sequence[Submission], fresh: list[int], estimates: dict[int, Quote]
    ) -> dict[int, ApiError]:
        """The new jobs of ``fresh`` refused before any write: shed, past their deadline, or
        past the queue's bounds (counting those of the group let in before them)."""
        refused: dict[int, ApiError] = {}
        taken: dict[str, tuple[int, int]] = {}
        for i in fresh:
            why = (
                self._shed(group[i])
                or self._refusal(group[i], i, estimates)
                or self._full(group[i], taken)
            )
            if why is not None:
                refused[i] = why
        return refused

    def _replays_or(
        self,
        group: Sequence[Submission],
        refusals: dict[int, ApiError],
        outcomes: list[Outcome | None],
    ) -> None:
        """Answer each refused submission with its refusal, unless its idempotency key's job
        exists: a replay is answered whatever the queue and the quota now."""
        existing = self._existing_at_once(
            {_idem(group[i]) for i in refusals if group[i].idempotency_key}
        )
        for i, why in refusals.items():
            found = existing.get(_idem(group[i])) if group[i].idempotency_key else None
            outcomes[i] = _replay(found, group[i]) if found is not None else why

    def _answer_taken(
        self, group: Sequence[Submission], taken: list[int], outcomes: list[Outcome | None]
    ) -> None:
        """Answer the submissions whose idempotency key another request committed meanwhile:
        its job's replay, or a 503 while that job is being taken back."""
        existing = self._existing_at_once({_idem(group[i]) for i in taken})
        for i in taken:
            outcomes[i] = _taken(existing.get(_idem(group[i])), group[i])

    def _existing_at_once(self, idems: set[tuple[str, str]]) -> dict[tuple[str, str], Job]:
        if not idems:
            return {}
        with self.sessions() as session:
            return self._existing(session, idems)

    def _existing(
        self, session: Session, idems: set[tuple[str, str]]
    ) -> dict[tuple[str, str], Job]:
        if not idems:
            return {}
        rows = session.scalars(
            select(Job).where(
                tuple_(Job.api_key_id, Job.idempotency_key).in_(sorted(idems)),
                Job.idempotency_key.is_not(None),  # what its partial unique index holds
            )
        )
        return {(row.api_key_id, row.idempotency_key or ""): row for row in rows}

    def _insert(self, session: Session, jobs: list[Job]) -> set[str]:
        """The jobs' rows, sent as multi-row INSERTs (SQLAlchemy's "insertmanyvalues": one
        statement, compiled once, for up to a thousand rows); the ids of the rows written.
        An idempotency key another process committed meanwhile makes its row a no-op."""
        if not jobs:
            return set()
        statement = _INSERTS[session.get_bind().dialect.name]
        return set(session.connection().scalars(statement, [at_once.row_of(job) for job in jobs]))

    def _enqueue(
        self,
        group: Sequence[Submission],
        jobs: dict[int, Job],
        outcomes: list[Outcome | None],
        estimates: dict[int, Quote],
    ) -> None:
        if not jobs:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            self.scripts.enqueue_all(
                pipe,
                self.prefix,
                (
                    (job.model, JobMessage.of_job(job, group[i].input_bytes))
                    for i, job in jobs.items()
                ),
            )
            self.scripts.execute(pipe)
        except REDIS_ERRORS as exc:
            self._not_enqueued(group, jobs, outcomes, exc)
            return
        for i, job in jobs.items():
            quote = estimates.get(i, Quote(None))
            outcomes[i] = Submitted(job, False, quote.wait_ms, quote.max_tokens)

    def _not_enqueued(
        self,
        group: Sequence[Submission],
        jobs: dict[int, Job],
        outcomes: list[Outcome | None],
        exc: Exception,
    ) -> None:
        """Redis is down: the committed jobs stay accepted (the reconciler enqueues them
        within ``requeue_within_s``), except those whose deadline is sooner: they are
        taken back and refused with 503. Redis at its maxmemory: every one is taken back
        and refused, as are the submissions of the next Retry-After seconds."""
        if isinstance(exc, OutOfMemoryError):
            # Room comes back only as workers acknowledge, and the reconciler could not
            # enqueue either: accepting would only pile up jobs nobody can queue.
            back = list(jobs)
            refusals = {
                model: self._memory_full(model) for model in {j.model for j in jobs.values()}
            }
            wait_s = max(int(r.headers["Retry-After"]) for r in refusals.values())
            self.memory_full_until = time.monotonic() + wait_s
        else:
            back = [
                i
                for i in jobs
                if group[i].body.deadline_ms is not None
                and group[i].body.deadline_ms < self.requeue_within_s * 1000  # type: ignore[operator]
            ]
            unavailable = ApiError(
                503, "unavailable", "the queue is unavailable; retry shortly", {"Retry-After": "2"}
            )
            refusals = {job.model: unavailable for job in jobs.values()}
        log.warning(
            "enqueue failed; the reconciler will enqueue the jobs",
            extra={
                "jobs": len(jobs) - len(back),
                "refused": len(back),
                "error_type": type(exc).__name__,
            },
        )
        for i, job in jobs.items():
            outcomes[i] = Submitted(job, False, None)
        if not back:
            return
        try:
            with self.sessions() as session:
                ids = [jobs[i].id for i in back]
                # Uncounted first (the rows must still be there to be counted),
                # then only the rows no worker has taken meanwhile are deleted.
                release_jobs(session, ids)
                deleted = set(
                    session.scalars(
                        delete(Job).where(Job.id.in_(ids), Job.status == "queued").returning(Job.id)
                    )
                )
                if deleted != set(ids):
                    session.rollback()  # a worker has one already: keep them all, accepted
                    return
                session.commit()
        except SQLAlchemyError:
            # Still in the database: accepted after all, the reconciler enqueues them.
            log.warning("refused jobs could not be taken back; kept", exc_info=True)
            return
        if self.taken_back is not None:
            self.taken_back(deleted)
        for i, outcome in enumerate(outcomes):
            # The requests answered with a taken-back job (a repeat of its key in
            # this group included) are refused with it.
            if isinstance(outcome, Submitted) and outcome.job.id in deleted:
                outcomes[i] = refusals[outcome.job.model]

    def _memory_full(self, model: str) -> ApiError:
        """A 503 while Redis is at its maxmemory: come back when the model's workers have
        acknowledged their next batch, which frees its entries."""
        view = self.views.get(model)
        with self.views.lock:
            wait = retry_after_s(view.drain_s(1) if view is not None else None)
        return ApiError(
            503,
            "queue_full",
            f"model: the queue's Redis is at its maxmemory; retry in about {wait} s",
            {"Retry-After": str(wait)},
            bound="maxmemory",
        )


def _generation_tokens(value: Any) -> tuple[int, int] | None:
    """A stored generation input's prompt_tokens and max_tokens (None for other inputs)."""
    if isinstance(value, dict) and "prompt_tokens" in value and "max_tokens" in value:
        return int(value["prompt_tokens"]), int(value["max_tokens"])
    return None


def _new_job(item: Submission) -> Job:
    deadline_ms = item.body.deadline_ms
    return Job(
        id=str(uuid.uuid4()),
        api_key_id=item.key.id,
        model=item.spec.name,
        requested_version=item.requested_version,
        priority=item.body.priority,
        status="queued",
        input=item.input,
        cost=item.cost,
        attempts=0,
        created_at=item.received_at,
        deadline_at=item.received_at + dt.timedelta(milliseconds=deadline_ms)
        if deadline_ms
        else None,
        callback_url=item.body.callback_url,
        callback_events=",".join(item.body.callback_events) if item.body.callback_events else None,
        idempotency_key=item.idempotency_key,
        metadata_=item.body.metadata,
        request_id=item.request_id,
        trace_context=item.trace_context,
    )


_JOBS: Table = Job.__table__  # type: ignore[assignment]
_INSERTS = {
    name: insert(_JOBS)
    .on_conflict_do_nothing(
        index_elements=[_JOBS.c.api_key_id, _JOBS.c.idempotency_key],
        index_where=_JOBS.c.idempotency_key.is_not(None),  # the partial unique index's
    )
    .returning(_JOBS.c.id)
    for name, insert in (("postgresql", postgresql.insert), ("sqlite", sqlite.insert))
}


def _idem(item: Submission) -> tuple[str, str]:
    return (item.key.id, item.idempotency_key or "")


def _taken(found: Job | None, item: Submission) -> Outcome:
    """The answer to a submission whose idempotency key another request committed while
    its group was written: that job's replay, or a 503 while it is being taken back."""
    if found is not None:
        return _replay(found, item)
    return ApiError(
        503,
        "unavailable",
        "the job with this idempotency_key is being taken back; retry shortly",
        {"Retry-After": "2"},
    )


def _firsts(
    group: Sequence[Submission], todo: list[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The submissions of ``todo`` to write, and the repeats of an idempotency key already
    among them: (index, index of the first with its key)."""
    fresh: list[int] = []
    first: dict[tuple[str, str], int] = {}
    repeats: list[tuple[int, int]] = []
    for i in todo:
        if not group[i].idempotency_key:
            fresh.append(i)
        elif (idem := _idem(group[i])) in first:
            repeats.append((i, first[idem]))
        else:
            first[idem] = i
            fresh.append(i)
    return fresh, repeats


def _answer_repeats(
    group: Sequence[Submission],
    repeats: list[tuple[int, int]],
    jobs: dict[int, Job],
    outcomes: list[Outcome | None],
) -> None:
    """A repeat of an idempotency key within the group is answered as its first was."""
    for i, earlier in repeats:
        answered = jobs.get(earlier)
        was = outcomes[earlier]
        if answered is None and isinstance(was, Submitted):
            answered = was.job
        outcomes[i] = _replay(answered, group[i]) if answered is not None else was


def _unavailable() -> ApiError:
    return ApiError(
        503, "unavailable", "the database is unavailable; retry shortly", {"Retry-After": "2"}
    )


def _replay(existing: Job, item: Submission) -> Outcome:
    if existing.model != item.spec.name or as_asked(existing.input) != as_asked(item.input):
        return ApiError(409, "conflict", "idempotency_key: already used for a different request")
    cut = isinstance(existing.input, dict) and ASKED_MAX_TOKENS in existing.input
    return Submitted(existing, True, None, existing.input["max_tokens"] if cut else None)


# A generation input whose max_tokens was cut to meet its deadline keeps what was asked.
ASKED_MAX_TOKENS = "asked_max_tokens"


def as_asked(value: Any) -> Any:
    """A stored input as its request gave it (a max_tokens cut to a deadline put back)."""
    if not isinstance(value, dict) or ASKED_MAX_TOKENS not in value:
        return value
    asked = {k: v for k, v in value.items() if k != ASKED_MAX_TOKENS}
    asked["max_tokens"] = value[ASKED_MAX_TOKENS]
    return asked


def _quota_error(limit: int | None) -> ApiError:
    return ApiError(
        429,
        "quota_exceeded",
        f"jobs outstanding: this key has {limit} jobs queued or running, its limit "
        "(FERRY_MAX_OUTSTANDING_JOBS); submit more as they finish",
        {"Retry-After": str(QUOTA_RETRY_AFTER_S)},
    )


def _database_error(exc: SQLAlchemyError) -> ApiError:
    log.warning("group commit failed", extra={"error_type": type(exc).__name__})
    if isinstance(exc, DataError):
        return ApiError(
            422,
            "invalid_request",
            "a value in the request cannot be stored (check for NUL "
            "characters and non-finite numbers)",
        )
    return _unavailable()


def _done(outcome: Outcome | None) -> Outcome:
    assert outcome is not None, "every submission of a group gets an outcome"
    return outcome
