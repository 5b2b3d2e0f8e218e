"""The loop of a generation model's worker: read, step, stream, record.

The worker's one loop (:class:`~workers.gpu.worker_loop.WorkerLoop`), for a
generation model: each step reads what fits from the model's streams into
the engine, stops the jobs clients cancelled, takes the scheduler's plan
(``workers.gpu.engine``), claims the jobs the plan starts (``running``,
attempts + 1), has the runtime decode one token for every running sequence
(and prefill the chunks the plan names), reports the output to the
scheduler, and then applies what the step did here and only here: every
new token goes to its job's events stream (``core.streams.events``), and every
job that ended is recorded, then acknowledged and announced on the done
channel. An entry is acknowledged only after its job's outcome is
committed, as for encoders; a worker that dies leaves its entries to be
taken over and the jobs run again.

A step's writes are one Redis pipeline (every token of the step) and, when
jobs ended, one transaction for their outcomes: their cost does not grow
with the tokens a step produces.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import redis
import torch
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from backends.generation.runtime import Completion, GenerationInput, StepResult, TokenLogprob
from backends.generation.sampling import SamplingParams
from backends.torch_runtime import check_device
from core.db.schema import TERMINAL_STATUSES, Job
from core.models.generation import prompt_token_ids, token_logprob_entry
from core.streams.events import JobEvent
from core.streams.protocol import cancels_key, done_channel, events_key
from scheduler.generation import FinishReason, GenerationRequest, StepPlan
from scheduler.generation_state import prefix_hashes
from scheduler.vocabulary import Lane
from workers.gpu.checkpoint import TokenWriter
from workers.gpu.consumer import Entry, StreamConsumer
from workers.gpu.engine import GenerationEngine, StepEvents
from workers.gpu.generation_signals import GenerationSignals
from workers.gpu.key_weights import KeyWeights
from workers.gpu.learned import Publisher
from workers.gpu.pipelined import Pipelined
from workers.gpu.recorder import Outcome, Recorder
from workers.gpu.recording import utc_at
from workers.gpu.versions import Loaded, VersionManager
from workers.gpu.worker_loop import OUTAGES, WorkerLoop

log = logging.getLogger(__name__)

IDLE_BLOCK_MS = 1000
# Held entries have their idle time reset this often (a fraction of the
# visibility timeout), so a long generation is never taken over while it runs.
TOUCH_FRACTION = 0.25
CANCEL_CHECK_S = 0.05
# A held job's events stream has its expiry renewed once this share of
# FERRY_EVENTS_TTL_S has passed: the stream is the generation's checkpoint, so
# it must outlive a generation longer than the TTL, for one EXPIRE a job now and then.
TTL_RENEW_FRACTION = 0.25


@dataclass
class _Held:
    """A job this worker holds: its entry, and when its tokens came."""

    entry: Entry
    enqueued_s: float
    started_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0  # the index of its next token
    streamed: int = 0  # tokens already in its events stream (written by a worker before)
    claimed: bool = False
    expiry_set_s: float | None = None  # when its events stream's expiry was last set
    progress: bool = False  # it asked for progress webhooks
    progress_s: float = 0.0  # when its last progress webhook was made (or it started)
    progress_tokens: int = 0  # the tokens that one said
    max_tokens: int = 0
    # Its tokens' logprob entries as its events carried them: its output reuses them
    # rather than decoding each token's texts again.
    logprobs: dict[TokenLogprob, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationConfig:
    prefetch: int = 256
    max_attempts: int = 3
    visibility_timeout_s: float = 120.0
    events_ttl_s: float = 3600.0
    progress_every_s: float = 5.0  # a job's progress webhooks (when it asked), at most this often
    drain_s: float = 30.0  # stopping: how long the running generations may take to finish
    pipeline: bool = False  # record what ended on a thread of its own while the next steps run
    checkpoint_every_tokens: int = 1  # a job's tokens to its stream once it has this many
    checkpoint_every_ms: float = 0.0  # ... or this long after the last write


@dataclass(frozen=True)
class GenerationServing:
    """What one version of a generation model serves with: its engine, tokenizer and signals."""

    engine: GenerationEngine
    tokenizer_path: Path
    signals: GenerationSignals
    device: str


@dataclass(frozen=True)
class GenerationStep:
    """A step's plan, and when it was scheduled (what the engine's reports are timed from)."""

    plan: StepPlan
    now: float


class GenerationLoop(WorkerLoop[GenerationStep, StepResult | Exception, StepEvents]):
    """One worker of a generation model: ``engine`` steps what ``consumer`` reads."""

    def __init__(
        self,
        *,
        serving: GenerationServing,
        consumer: StreamConsumer,
        recorder: Recorder,
        client: redis.Redis,
        prefix: str,
        config: GenerationConfig = GenerationConfig(),
        kick: Callable[[list[str]], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock)
        self.serving = serving
        self.consumer = consumer
        self.recorder = recorder
        self.client = client
        self.prefix = prefix
        self.config = config
        self.kick = kick
        self.held: dict[str, _Held] = {}
        self.weights = KeyWeights(recorder.sessions)
        # Pipelined: one thread writes what ended (result, done event, acknowledgement,
        # webhooks) while the loop's thread steps on.
        self._recording: Pipelined[list[str]] = Pipelined(
            f"record-{consumer.model}", config.pipeline
        )
        # The tokens to their events streams (the checkpoint): pipelined, on a thread of
        # their own while the next step computes.
        self.writer = TokenWriter(
            client,
            config.checkpoint_every_tokens,
            config.checkpoint_every_ms,
            config.pipeline,
            consumer.model,
        )
        self.publisher = Publisher(client, prefix, consumer.model, consumer.consumer, clock)
        self.tokens = 0
        self._last_touch = time.monotonic()
        self._took_over = False  # the last upkeep took entries over: read without waiting
        self._last_cancel_check = 0.0
        self._stopping = False
        # Hot reload: when set, the loop switches to the versions it loads.
        self.versions: VersionManager | None = None
        # A version loaded and waiting for the old one's sequences to finish.
        self._switching: Loaded | None = None
        # Jobs pinned to the version being loaded were left unread, to wait for it.
        self._pins_waiting = False

    @property
    def engine(self) -> GenerationEngine:
        return self.serving.engine

    @property
    def tokenizer_path(self) -> Path:
        return self.serving.tokenizer_path

    @property
    def signals(self) -> GenerationSignals:
        return self.serving.signals

    @property
    def device(self) -> str:
        return self.serving.device

    @property
    def version(self) -> int | None:
        """The version new jobs start on."""
        return self.recorder.model_version

    @property
    def switching_to(self) -> int | None:
        """A version loaded and waiting for the old one's sequences to end (None: none)."""
        return None if self._switching is None else self._switching.version

    @property
    def held_count(self) -> int:
        return len(self.held)

    def request_stop(self) -> None:
        self._stopping = True
        if self.stop_event is not None:
            self.stop_event.set()

    # --- running ---------------------------------------------------------------

    def finish_running(self) -> None:
        """Stopping: read nothing more and let what runs finish, for at most drain_s.

        What is still running then stays unacknowledged: another worker (or
        this one, restarted) takes it over and runs it again.
        """
        self._stopping = True
        ends = time.monotonic() + self.config.drain_s
        with contextlib.suppress(*OUTAGES):
            while self.engine.scheduler.running_count and time.monotonic() < ends:
                self.step()

    def begin(self) -> None:
        if self.versions is not None:
            self.versions.start()

    def close(self) -> None:
        """What ended is recorded before the worker stops."""
        with contextlib.suppress(*OUTAGES):
            self.writer.write()  # the tokens of generations still held, for whoever goes on
        self._settle_recording()
        self.writer.close()
        self._recording.close()
        if self.versions is not None:
            self.versions.stop()

    def forget(self) -> None:
        # What is being recorded is done (or given up) before anything is read again:
        # a job read again before its result is committed would run again.
        self._settle_recording()
        # Whatever the failure interrupted (a plan scheduled and not reported, a claim
        # half done), the engine starts afresh: everything held is read again, and goes
        # on from its stream (tokens not yet written are made again).
        self.writer.discard()
        self.engine.reset()
        self.held.clear()
        self.consumer.reread_pending()

    # --- a step ----------------------------------------------------------------

    def upkeep(self) -> None:
        if self.versions is not None:
            self.versions.collect_dropped()
        if self.writer.done() or self._recording.done():
            self._wait_recorded()  # a write that failed is heard of now, even when idle
        self.publisher.heartbeat()
        self._upkeep()
        self._follow_version()

    def read(self, block_ms: int | None) -> None:
        if self._took_over:
            block_ms, self._took_over = None, False
        if not self._stopping and self._switching is None:
            self._read(block_ms)

    def schedule(self, now: float) -> GenerationStep:
        """The cancellations asked for since the last step, then the scheduler's plan."""
        self._cancels()
        return GenerationStep(self.engine.schedule(now), now)

    def start(self, step: GenerationStep) -> None:
        if step.plan.admitted:
            self._claim(list(step.plan.admitted), step.now)

    def execute(self, step: GenerationStep) -> StepResult | Exception:
        """The step run by the runtime, or what it raised (its sequences are then isolated)."""
        try:
            return self.engine.execute(step.plan)
        except Exception as exc:
            # The error, not the device's name, tells a broken CUDA context: check_device
            # probes after a CUDA error only, and raises DeviceLost (the worker stops) when
            # the probe fails too; a step's own error isolates its sequences.
            check_device(torch, self.device, exc)
            return exc

    def update_from_output(
        self, step: GenerationStep, output: StepResult | Exception
    ) -> StepEvents:
        if isinstance(output, Exception):
            events = self.engine.abort(step.plan, output)
            self._isolate(events.aborted, output)
            return events
        return self.engine.update_from_output(step.plan, output, step.now)

    def _isolate(self, aborted: tuple[str, ...], error: Exception) -> None:
        """A step raised: run each of its sequences again alone, and fail one that raised alone.

        As for an encoder batch that raises, only the jobs at fault fail: a
        step of several sequences proves nothing against any one of them, so
        each runs again with nothing beside it (from the tokens it had); a
        step of one sequence that raises fails its job.
        """
        if len(aborted) == 1:
            (job_id,) = aborted
            why = (str(error) or type(error).__name__).splitlines()[0][:500]
            self.engine.fail(job_id)
            log.error(
                "a generation failed on its own; the job fails",
                extra={"model": self.model, "job_id": job_id, "error_type": type(error).__name__},
            )
            held = self.held.get(job_id)
            if held is not None:
                self.signals.job_ended(held.entry.message.lane, "failed", 0, {})
                # Recorded at once: nothing of it is left in the engine to report later.
                error_text = f"the model failed on it ({type(error).__name__}: {why})"
                self._record([Outcome(job_id, "failed", error=error_text)])
        else:
            log.warning(
                "a generation step failed; its sequences run again, each alone",
                extra={
                    "model": self.model,
                    "sequences": len(aborted),
                    "error_type": type(error).__name__,
                },
            )

    def apply(self, events: StepEvents) -> None:
        self._apply(events)
        self.signals.stepped(events, self.engine.scheduler)

    def ran(self, step: GenerationStep) -> bool:
        return not step.plan.empty

    def next_wait_ms(self, step: GenerationStep) -> int | None:
        """No wait while sequences run or wait; idle, until the nearest deadline or a second."""
        plan = step.plan
        scheduler = self.engine.scheduler
        if not plan.empty or scheduler.running_count:
            return None
        if plan.wait_s is not None:
            return min(IDLE_BLOCK_MS, int(plan.wait_s * 1000)) or None
        return None if scheduler.waiting_count else IDLE_BLOCK_MS

    # --- reading -----------------------------------------------------------------

    def _read(self, block_ms: int | None) -> None:
        room = self.config.prefetch - len(self.held)
        if room <= 0:
            return
        self._take(self.consumer.read(room, block_ms))

    def _take(self, entries: list[Entry]) -> None:
        fresh = [e for e in entries if e.message.job_id not in self.held]
        if not fresh:
            return
        ids = [e.message.job_id for e in fresh]
        with self.recorder.sessions() as session:
            rows = session.execute(
                select(Job.id, Job.input, Job.attempts).where(
                    Job.id.in_(ids), Job.status.not_in(TERMINAL_STATUSES)
                )
            ).all()
        inputs: dict[str, Any] = {job_id: value for job_id, value, _ in rows}
        # Started before and not finished: its worker died (or gave it up) mid-generation.
        taken_over = {job_id for job_id, _, attempts in rows if attempts}
        gone = [e for e in fresh if e.message.job_id not in inputs]
        if gone:  # cancelled, or recorded already by another worker: nothing to run
            self.consumer.ack(gone)
        refused: list[Outcome] = []
        for entry in fresh:
            value = inputs.get(entry.message.job_id)
            if value is None:
                continue
            message = entry.message
            pin = message.version
            if pin is not None and pin != self.version:
                if self._loading(pin):
                    self._pins_waiting = True
                    continue  # read again once that version serves (or its load failed)
                active = self.versions.wanted if self.versions is not None else self.version
                refused.append(
                    Outcome(
                        message.job_id,
                        "failed",
                        error=f"version {pin} of {self.model} is not served now "
                        f"(the active version is {active}; serving {self.version})",
                    )
                )
                self.held[message.job_id] = _Held(entry, message.enqueued_at_ms / 1000.0)
                continue
            held = _Held(entry, message.enqueued_at_ms / 1000.0)
            try:
                job = generation_input(value, self.tokenizer_path, message.job_id)
                if message.job_id in taken_over:
                    job = self._resume(job, held)
                request = GenerationRequest(
                    id=message.job_id,
                    prompt_tokens=len(job.prompt_ids),
                    max_tokens=job.max_tokens,
                    lane=Lane(message.lane),
                    tenant=message.tenant or "",
                    deadline=message.deadline_at_ms / 1000.0 if message.deadline_at_ms else None,
                    arrival=message.enqueued_at_ms / 1000.0,
                    generated=len(job.resumed),
                    weight=self.weights.of(message.tenant),
                    prefix=self._prefix(job),
                )
                self.engine.add(request, job)
                held.max_tokens = request.max_tokens
                self.signals.job_read(request.prompt_tokens, request.max_tokens)
            except (ValueError, KeyError, TypeError) as exc:
                refused.append(Outcome(message.job_id, "failed", error=f"cannot run: {exc}"))
            self.held[message.job_id] = held
        if refused:
            self._record(refused)

    def _prefix(self, job: GenerationInput) -> tuple[int, ...]:
        """The prompt's prefix blocks, for the scheduler to share (prefix caching)."""
        if not getattr(self.engine.runtime, "prefix_caching", False):
            return ()
        if job.prompt_logprobs is not None:
            return ()  # a scored prompt computes every position: none is shared
        return prefix_hashes(job.prompt_ids, self.engine.scheduler.limits.block_size)

    def _resume(self, job: GenerationInput, held: _Held) -> GenerationInput:
        """A job taken over goes on from the tokens its events stream holds (its checkpoint).

        Every token a worker produced went to the stream in the step that
        produced it, so the stream is the generation's checkpoint, to the
        token. The last one is computed again (it may be the end of the
        sequence, which a resumed one must find for itself) and kept as it was
        shown: in full precision it is the same token, from the same logits
        and the same draw; in reduced precision a prefill may round otherwise
        than the decode step that made it, and the stream's token stands. It
        is not streamed twice. A runtime that cannot go on from tokens runs
        the job again from its prompt; what is already streamed is not
        repeated.
        """
        key = events_key(self.prefix, self.model, held.entry.message.job_id)
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        first_ms: int | None = None
        stream = cast(list[tuple[str, dict[bytes | str, bytes | str]]], self.client.xrange(key))
        for entry_id, fields in stream:
            event = JobEvent.decode(fields)
            if event.kind == "token" and event.index == len(tokens) and event.token is not None:
                if first_ms is None:
                    first_ms = int(entry_id.split("-", 1)[0])  # the id's milliseconds
                tokens.append(event.token)
                logprobs.append(_token_logprob(event.token, event.logprob))
        held.streamed = len(tokens)
        if first_ms is not None:
            held.first_token_s = first_ms / 1000.0
        if not self.engine.runtime.resumable or not tokens:
            return job
        kept = tuple(tokens[: min(len(tokens), job.max_tokens) - 1])
        shown = tokens[len(kept)]
        kept_logprobs = tuple(lp for lp in logprobs[: len(kept)] if lp is not None)
        if job.logprobs is not None and len(kept_logprobs) < len(kept):
            # Streamed without them (by a worker before this version): run it again whole,
            # the tokens already streamed not repeated, so that every token has its own.
            return job
        held.tokens = len(kept)
        log.info(
            "generation taken over from its checkpoint",
            extra={"model": self.model, "job_id": held.entry.message.job_id, "tokens": len(kept)},
        )
        return replace(job, resumed=kept, shown=shown, resumed_logprobs=kept_logprobs)

    def _upkeep(self) -> None:
        now = time.monotonic()
        if now - self._last_touch < self.config.visibility_timeout_s * TOUCH_FRACTION:
            return
        self._last_touch = now
        lost = self.consumer.touch([h.entry for h in self.held.values()])
        for entry in lost:  # another worker took it over while this one stalled
            self.engine.cancel(entry.message.job_id)
            self.held.pop(entry.message.job_id, None)
        room = self.config.prefetch - len(self.held)
        if room > 0 and self._switching is None:
            before = len(self.held)
            self._take(self.consumer.reclaim(int(self.config.visibility_timeout_s * 1000), room))
            # Taken over: it runs this step, not after the idle wait the last step set.
            self._took_over = len(self.held) > before

    # --- versions ------------------------------------------------------------------

    def _follow_version(self) -> None:
        """Switch to a version the manager loaded, once the old one's sequences are done.

        A generation belongs to the version that started it: its tokens and KV
        are that model's. Once another version is loaded, the old one admits
        nothing new (the jobs waiting that never started are let go, to be read
        again), runs what it started to the end, and then the new one takes
        over; a job records the version that ran it.
        """
        if self.versions is None:
            return
        loaded = self.versions.poll()
        if loaded is not None:
            if self._switching is not None:
                self.versions.unloaded(self._switching)  # superseded before it served
            self._switching = loaded
            self._let_go_unstarted()
        else:
            self._restart_in_turn(self.versions)  # what runs finishes first (finish_running)
        if self._switching is not None and self._switching.version != self.versions.wanted:
            # Rolled back (or another activated) before it served: what was let go runs
            # on the version served, once what ended meanwhile is written.
            self._wait_recorded()
            self.versions.unloaded(self._switching)
            self._switching = None
            self.consumer.reread_pending()
        if self._pins_waiting and self.versions.failed(self.versions.wanted):
            # Jobs pinned to the version being loaded were left unread; its load failed:
            # read them again now (they fail, saying so) rather than at a takeover.
            self._pins_waiting = False
            self._wait_recorded()
            self.consumer.reread_pending()
        scheduler = self.engine.scheduler
        if self._switching is not None and not scheduler.running_count:
            if scheduler.waiting_count:
                self._let_go_unstarted()  # preempted ones resume on the old version first
            if not scheduler.waiting_count:
                self._switch(self._switching)

    def _loading(self, version: int) -> bool:
        """Whether ``version`` is the one this worker is loading (a job pinned to it waits)."""
        manager = self.versions
        return manager is not None and version == manager.wanted and not manager.failed(version)

    def _let_go_unstarted(self) -> None:
        """Jobs held and never started leave the old engine, unacknowledged (read again later)."""
        for job_id, held in list(self.held.items()):
            if not held.claimed and self.engine.scheduler.state_of(job_id) == "waiting":
                self.engine.cancel(job_id)
                del self.held[job_id]  # its cancellation ends with nothing recorded

    def _switch(self, loaded: Loaded) -> None:
        assert self.versions is not None
        # Its last outcomes are written before anything is read again (an outage here
        # leaves the switch to the next try, the version still loaded).
        self._wait_recorded()
        self._switching = None
        # The old engine goes with what it still holds: only the jobs let go, none started.
        self.serving = loaded.prepared
        self.recorder.model_version = loaded.version
        self._pins_waiting = False  # read again below, onto the version they asked for
        old = self.versions.switched(loaded)
        self.versions.unloaded(old)
        # What was let go is read again, now onto the new version.
        self.consumer.reread_pending()

    def _cancels(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_check < CANCEL_CHECK_S or not self.held:
            return
        self._last_cancel_check = now
        key = cancels_key(self.prefix, self.model)
        asked = [str(m) for m in self.client.smembers(key)]
        ours = [job_id for job_id in asked if job_id in self.held]
        if ours:
            for job_id in ours:
                self.engine.cancel(job_id)
            self.client.srem(key, *ours)

    # --- applying a step ---------------------------------------------------------

    def _apply(self, events: StepEvents) -> None:
        now = self.clock()
        if events.emitted:
            first = False
            for job_id, emitted in events.emitted.items():
                held = self.held.get(job_id)
                if held is None or not held.claimed:
                    continue  # not this worker's to stream (its claim was refused)
                if held.first_token_s is None:
                    held.first_token_s = now
                    first = True  # its client waits for it: written in this step
                held.last_token_s = now
                key = events_key(self.prefix, self.model, job_id)
                if held.tokens >= held.streamed:  # not already streamed by a worker before
                    logprob = None
                    if emitted.logprob is not None:
                        logprob = logprob_entry(self.tokenizer_path, emitted.logprob)
                        held.logprobs[emitted.logprob] = logprob
                    event = JobEvent.token_event(held.tokens, emitted.token, emitted.text, logprob)
                    self.writer.add(key, event)
                if self._expiry_due(held, now):
                    self.writer.expire(key, max(1, int(self.config.events_ttl_s)))
                held.tokens += 1
            self.writer.step(urgent=first)
            self.tokens += len(events.emitted)
            self._progress(now)
        if events.ended:
            outcomes = [self._outcome(job_id, c, now) for job_id, c in events.ended.items()]
            self._record([o for o in outcomes if o is not None], events.ended)

    def _progress(self, now: float) -> None:
        """Make the progress webhooks due (jobs that asked, every ``progress_every_s`` while
        they make tokens), and hand them to Celery. A database that fails here delays them
        to the next step: the generation goes on."""
        every_s = self.config.progress_every_s
        due = {
            job_id: held
            for job_id, held in self.held.items()
            if held.progress
            and held.claimed
            and now - held.progress_s >= every_s
            and held.tokens > held.progress_tokens
        }
        if not due:
            return
        tokens = {job_id: (held.tokens, held.max_tokens) for job_id, held in due.items()}
        try:
            self.recorder.progress(tokens, utc_at(now))
        except SQLAlchemyError as exc:
            log.warning(
                "progress webhooks not made; tried again at the next step",
                extra={"model": self.model, "error_type": type(exc).__name__},
            )
            return
        for held in due.values():
            held.progress_s, held.progress_tokens = now, held.tokens
        deliveries = self.recorder.take_outbox()
        if deliveries:
            self._kick(deliveries)

    def _expiry_due(self, held: _Held, now: float) -> bool:
        """Whether the job's stream is due its expiry: none of ours yet, or a quarter of it
        has passed (then it counts as set now)."""
        ttl_s = self.config.events_ttl_s
        if held.expiry_set_s is None or now - held.expiry_set_s >= ttl_s * TTL_RENEW_FRACTION:
            held.expiry_set_s = now
            return True
        return False

    def _claim(self, job_ids: list[str], now: float) -> None:
        claimed, late, exhausted, _ = self.recorder.claim(
            job_ids, utc_at(now), self.config.max_attempts, webhooks=True
        )
        took = {c.job_id for c in claimed}
        for job in claimed:
            held = self.held[job.job_id]
            held.progress, held.progress_s = job.progress, now
        pipe = self.client.pipeline(transaction=False)
        for job_id in took:
            held = self.held[job_id]
            held.claimed = True
            held.started_s = now
            key = events_key(self.prefix, self.model, job_id)
            pipe.xadd(key, JobEvent.running().encode())  # type: ignore[arg-type]
            if self._expiry_due(held, now):
                pipe.expire(key, max(1, int(self.config.events_ttl_s)))
        pipe.execute()
        started = self.recorder.take_outbox()  # the job.started webhooks of the claim
        if started:
            self._kick(started)
        for job_id in job_ids:
            if job_id not in took:
                # Late, exhausted, or ended meanwhile (cancelled while queued): stop it;
                # its outcome is recorded when the engine reports it ended.
                self.engine.cancel(job_id)
        failed = [
            Outcome(
                j, "failed", error=f"started {self.config.max_attempts} times without finishing"
            )
            for j in exhausted
        ]
        expired = [Outcome(j, "expired", error="the deadline passed before it ran") for j in late]
        if failed or expired:
            self._record(failed + expired)

    def _outcome(self, job_id: str, completion: Completion, now: float) -> Outcome | None:
        held = self.held.get(job_id)
        if held is None:
            return None
        reason = completion.finish_reason
        lane = held.entry.message.lane
        if reason == FinishReason.EXPIRED and held.claimed:
            # Out of time mid-generation: it ends expired, with the tokens it produced.
            output = completion_output(completion, held, now, self.tokenizer_path)
            self.signals.job_ended(lane, str(reason), len(completion.token_ids), {})
            return Outcome(
                job_id,
                "expired",
                output=output,
                error=f"its deadline passed while it generated "
                f"({len(completion.token_ids)} tokens)",
            )
        if reason == FinishReason.EXPIRED or not held.claimed:
            self.signals.job_ended(lane, str(reason), 0, {})
        if reason == FinishReason.EXPIRED:
            return Outcome(job_id, "expired", error="its deadline could not be met")
        if not held.claimed:
            # Never started here (late, exhausted, cancelled while queued): its entry
            # is acknowledged; whatever ended it recorded it already.
            return Outcome(job_id, "cancelled", error="cancelled by the client")
        status = "cancelled" if reason == FinishReason.CANCELLED else "succeeded"
        output = completion_output(completion, held, now, self.tokenizer_path)
        self.signals.job_ended(lane, str(reason), len(completion.token_ids), output["timings"])
        return Outcome(
            job_id,
            status,
            output=output,
            error="cancelled by the client" if status == "cancelled" else None,
            inference_ms=None
            if held.first_token_s is None
            else round((now - held.first_token_s) * 1000.0, 3),
        )

    def _record(self, outcomes: list[Outcome], ended: Iterable[str] = ()) -> None:
        """Record what ended: now, or (pipelined) on the recording thread while the next
        steps run. The jobs leave ``held`` either way (and ``ended``'s, recorded or not).

        One recording at most is in flight: before handing the next over, the
        last must be done, and what it raised (the database gone) is raised
        here, in the loop, as an encoder's is.
        """
        entries = [self.held[o.job_id].entry for o in outcomes if o.job_id in self.held]
        for job_id in [*ended, *(o.job_id for o in outcomes)]:
            self.held.pop(job_id, None)
        if not outcomes:
            return
        self.writer.write()  # a job's done event follows its last tokens
        try:
            self._recording.wait()
        finally:
            # Handed over even when the last recording failed: these jobs ended, and
            # their own recording may well succeed. Their last tokens may still be on
            # their way to the streams: the recording waits for them.
            self._recording.submit(self._write, outcomes, entries, self.writer.in_flight)

    def _wait_recorded(self) -> None:
        """Until the appends and the recording in flight are done; re-raises what they
        raised."""
        try:
            self.writer.wait()
        finally:
            self._recording.wait()

    def _settle_recording(self) -> None:
        """Wait for the recording in flight; one that failed leaves its jobs to run again."""
        try:
            self._wait_recorded()
        except OUTAGES as exc:
            log.warning(
                "a step's results were not recorded; its jobs run again",
                extra={"model": self.model, "error_type": type(exc).__name__},
            )

    def _write(
        self, outcomes: list[Outcome], entries: list[Entry], after: Future[Any] | None = None
    ) -> list[str]:
        """Commit the outcomes, write their done events, acknowledge, announce; ``after``:
        the appends of the jobs' last tokens, done first (a done event follows the tokens)."""
        if after is not None:
            after.result()
        written = self.recorder.finish(outcomes, utc_at(self.clock()), None, None)
        won = set(written)
        pipe = self.client.pipeline(transaction=False)
        for outcome in outcomes:
            if outcome.job_id not in won:
                continue
            key = events_key(self.prefix, self.model, outcome.job_id)
            reason = (
                outcome.output.get("finish_reason") if isinstance(outcome.output, dict) else None
            )
            pipe.xadd(key, JobEvent.done(outcome.status, reason).encode())  # type: ignore[arg-type]
            pipe.expire(key, int(self.config.events_ttl_s))
        pipe.execute()
        publish = (done_channel(self.prefix), ",".join(written)) if written else None
        self.consumer.ack(entries, publish=publish)
        deliveries = self.recorder.take_outbox()
        if deliveries:
            self._kick(deliveries)
        return written

    def _kick(self, deliveries: list[str]) -> None:
        """Hand webhook deliveries committed with the outcomes to Celery."""
        if self.kick is None:
            return
        try:
            self.kick(deliveries)
        except Exception as exc:  # the beat's sweep sends them later
            log.warning(
                "webhook deliveries not kicked",
                extra={"model": self.model, "error_type": type(exc).__name__},
            )


def generation_input(
    value: dict[str, Any], tokenizer_path: Path, job_id: str | None = None
) -> GenerationInput:
    """A stored (validated) generation input as the runtime takes it.

    A sampled job without a ``seed`` gets one from its id: every worker that
    runs it (one taking it over after a crash) draws the same tokens.
    """
    ids = prompt_token_ids(value, tokenizer_path)
    seed = value.get("seed")
    if seed is None and job_id is not None:
        seed = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") >> 1
    return GenerationInput(
        prompt_ids=tuple(ids),
        max_tokens=int(value["max_tokens"]),
        sampling=SamplingParams(
            temperature=float(value.get("temperature", 1.0)),
            top_p=float(value.get("top_p", 1.0)),
            seed=seed,
            presence_penalty=float(value.get("presence_penalty") or 0.0),
            frequency_penalty=float(value.get("frequency_penalty") or 0.0),
            logit_bias=tuple(
                sorted(
                    (int(token), float(bias)) for token, bias in value.get("logit_bias", {}).items()
                )
            ),
        ),
        stop=tuple(value.get("stop") or ()),
        logprobs=value.get("logprobs"),
        prompt_logprobs=value.get("prompt_logprobs"),
    )


def completion_output(
    completion: Completion, held: _Held, now: float, tokenizer: Path
) -> dict[str, Any]:
    """What a generation job's row stores as its output (``tokenizer``: the model's
    tokenizer.json, for the texts of the tokens in ``logprobs``)."""
    completion_tokens = len(completion.token_ids)
    ttft_ms = (
        None
        if held.first_token_s is None
        else round((held.first_token_s - held.enqueued_s) * 1000.0, 3)
    )
    queue_ms = (
        None if held.started_s is None else round((held.started_s - held.enqueued_s) * 1000.0, 3)
    )
    tpot_ms = None
    if held.first_token_s is not None and held.last_token_s is not None and completion_tokens > 1:
        tpot_ms = round(
            (held.last_token_s - held.first_token_s) * 1000.0 / (completion_tokens - 1), 3
        )
    output: dict[str, Any] = {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": str(completion.finish_reason),
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": completion.prompt_tokens + completion_tokens,
        },
        "seed": completion.seed,
        "timings": {"queue_ms": queue_ms, "ttft_ms": ttft_ms, "tpot_ms": tpot_ms},
    }
    if completion.logprobs is not None:
        output["logprobs"] = [
            held.logprobs.get(found) or logprob_entry(tokenizer, found)
            for found in completion.logprobs
        ]
    if completion.prompt_logprobs is not None:
        output["prompt_logprobs"] = [
            token_logprob_entry(tokenizer, token, None, ())  # the first: nothing before it
            if found is None
            else logprob_entry(tokenizer, found)
            for token, found in zip(completion.prompt_ids, completion.prompt_logprobs, strict=True)
        ]
    return output


def logprob_entry(tokenizer: Path, found: TokenLogprob) -> dict[str, Any]:
    return token_logprob_entry(tokenizer, found.token, found.logprob, found.top)


def _token_logprob(token: int, entry: dict[str, Any] | None) -> TokenLogprob | None:
    """A streamed token's logprob (an event's), as the runtime holds it."""
    if entry is None:
        return None
    top = tuple((int(t["token"]), float(t["logprob"])) for t in entry.get("top_logprobs", ()))
    return TokenLogprob(token, float(entry["logprob"]), top)
