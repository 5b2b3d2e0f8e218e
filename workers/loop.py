"""The batch loop of one GPU worker: read, decide, run, record, acknowledge.

The loop applies the scheduler's decisions; it never decides itself. An entry
is acknowledged only after its job's outcome is committed (or after it was
found to need no run: cancelled, missing, already finished).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError, StatementError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from backends.base import DeviceLost, Launched, Runtime
from core.queues import HEARTBEAT_TTL_S
from core.streams import done_channel, stats_key, workers_key
from scheduler import BatchDecision, PendingItem
from scheduler.learning import BatchObservation, SchedulerState
from scheduler.policy import efficiency
from workers.consumer import Entry, StreamConsumer
from workers.execute import ItemResult, check_outputs, run_isolating
from workers.observe import LoopMetrics
from workers.presence import BatchEvents
from workers.recorder import Claimed, Outcome, Recorder
from workers.scheduling import Policy, estimate_of
from workers.versions import Loaded, VersionManager

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
# What the worker learned is published at most this often: the API reads it at
# most every 250 ms (api.submissions.VIEW_TTL_S), so a write per batch is waste.
PUBLISH_S = 0.25
MAX_BLOCK_MS = 1000
# How often jobs pinned to a version no longer served are looked for.
PIN_CHECK_S = 0.5
RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0
# Why a batch may be prepared while the one before computes: it will not grow
# by waiting (size, cost, memory, latency limits) or must not wait.
AHEAD_TRIGGERS = frozenset({"size", "cost", "memory", "latency", "urgent", "deadline"})


@dataclass
class LoopStats:
    """Running averages of recent batches (what /v1/models and the API's estimates show)."""

    batches: int = 0
    jobs: int = 0
    avg_batch_ms: float = 0.0
    avg_batch_size: float = 0.0
    mean_cost: float = 0.0  # per item
    pad_ratio: float = 1.0  # work / sum of costs
    efficiency: float = 1.0

    def add(self, size: int, cost: int, work: float, batch_ms: float, eff: float) -> None:
        self.batches += 1
        self.jobs += size
        alpha = 1.0 if self.batches == 1 else 0.2
        self.avg_batch_ms += alpha * (batch_ms - self.avg_batch_ms)
        self.avg_batch_size += alpha * (size - self.avg_batch_size)
        self.mean_cost += alpha * (cost / size - self.mean_cost)
        self.pad_ratio += alpha * (work / max(cost, 1) - self.pad_ratio)
        self.efficiency += alpha * (eff - self.efficiency)


class BatchLoop:
    def __init__(
        self,
        *,
        runtime: Runtime,
        consumer: StreamConsumer,
        recorder: Recorder,
        client: redis.Redis,
        prefix: str,
        state: SchedulerState,
        policy: Policy,
        prefetch: int,
        max_attempts: int = 3,
        visibility_timeout_s: float = 120.0,
        drain_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        kick: Callable[[list[str]], None] | None = None,
        events: BatchEvents | None = None,
        pipeline: bool = False,
        launch_ahead: bool = False,
    ) -> None:
        self.runtime = runtime
        self.consumer = consumer
        self.recorder = recorder
        self.client = client
        self.prefix = prefix
        self.state = state
        self.policy = policy
        self.prefetch = max(prefetch, state.tuning.max_batch_size)
        self.max_attempts = max_attempts
        self.visibility_timeout_s = visibility_timeout_s
        self.drain_s = drain_s
        self.clock = clock
        # Hands new webhook deliveries to Celery once their jobs are acknowledged.
        self.kick = kick
        self.metrics = LoopMetrics(consumer.model, runtime.device)
        # Each batch as a Celery task, for Flower (workers.presence).
        self.events = events
        # The model's own settings from its model.toml (what Flower's conf shows).
        self.model_settings: dict[str, Any] = {}
        # Hot reload: when set, the loop switches to the versions it loads.
        self.versions: VersionManager | None = None
        # The loop stopped so that its process restarts with another version.
        self.restart_requested = False
        self._pins_checked = 0.0
        # Set once the worker reads its streams; cleared when it stops (the /readyz of its port).
        self.ready = threading.Event()
        # Terminal statuses written and not yet acknowledged, for the metrics.
        self._written_status: dict[str, str] = {}
        self._stop = threading.Event()
        self._stop_requested_at: float | None = None
        self._last_upkeep = time.monotonic()
        self.pending: dict[str, Entry] = {}
        # Entries taken into a batch and not yet acknowledged (on the device,
        # being recorded): reading this consumer's backlog again returns them.
        self._running: set[str] = set()
        # Pipelined: one thread records batch N (result write, acknowledgement,
        # webhooks) while this one computes batch N + 1.
        self._recording = (
            ThreadPoolExecutor(1, thread_name_prefix=f"record-{consumer.model}")
            if pipeline
            else None
        )
        self._recorded: Future[None] | None = None
        # On a device that computes asynchronously: batch N + 1 is decided,
        # claimed and prepared (tokenised, decoded, staged) while batch N
        # computes, and launched the moment N is done.
        self._launch_ahead = launch_ahead
        self._ahead = launch_ahead and runtime.asynchronous
        self._in_flight: _InFlight | None = None
        # Per tenant, the number of the batch that last ran one of its jobs
        # (the scheduler takes tenants in turn, least recently served first).
        self._served: dict[str, int] = {}
        self._batches = 0
        self.stats = LoopStats()
        self._last_beat = 0.0
        self._published_at = 0.0
        self._unpublished = False

    @property
    def model(self) -> str:
        return self.consumer.model

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        self._retrying(stop, self.consumer.ensure_groups)
        self._retrying(stop, self._publish)
        if self.versions is not None:
            self.versions.start()
        self.ready.set()
        log.info("worker ready", extra={"model": self.model, "consumer": self.consumer.consumer})
        wait_ms: int | None = MAX_BLOCK_MS
        backoff_s = RETRY_MIN_S
        try:
            while not stop.is_set():
                try:
                    wait_ms = self.step(wait_ms)
                    backoff_s = RETRY_MIN_S
                    if not stop.is_set():
                        self.ready.set()
                except (redis.RedisError, SQLAlchemyError) as exc:
                    self.ready.clear()  # it can run nothing until Redis and the database are back
                    # Whatever was read but not recorded is still pending in Redis:
                    # forget the local copy and read it again once things are back.
                    log.warning(
                        "dependency error; retrying",
                        extra={"model": self.model, "error_type": type(exc).__name__,
                               "retry_in_s": backoff_s},
                    )  # fmt: skip
                    self._settle_recording()
                    self.pending.clear()
                    self._running.clear()
                    self.consumer.reread_pending()
                    stop.wait(backoff_s)
                    if isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
                        # Redis lost its data (restarted empty, failed over): make the
                        # groups again; the reconciler re-enqueues what was lost.
                        with contextlib.suppress(redis.RedisError):
                            self.consumer.ensure_groups()
                    backoff_s = min(backoff_s * 2, RETRY_MAX_S)
                    wait_ms = MAX_BLOCK_MS
        finally:
            lost = None
            try:
                self._settle_recording()  # the last batch's results are written before it stops
            except DeviceLost as exc:
                lost = exc
            if self._recording is not None:
                self._recording.shutdown(wait=True)
            if self.versions is not None:
                self.versions.stop()
            self.ready.clear()
            # Entries read but not run stay unacknowledged; this consumer name gets
            # them back at its next start.
            with contextlib.suppress(redis.RedisError):
                self.client.zrem(workers_key(self.prefix, self.model), self.consumer.consumer)
            log.info(
                "worker stopped", extra={"model": self.model, "left_pending": len(self.pending)}
            )
            if lost is not None:
                raise lost

    def step(self, wait_ms: int | None) -> int | None:
        """One turn: read, decide, apply. Returns how long the next read may block."""
        if self._recorded is not None and self._recorded.done():
            self.wait_recorded()  # a recording that failed is heard of now, even when idle
        self._heartbeat()
        self._upkeep()
        self._follow_version()
        # While a batch computes, read only what is there already: it is landed next.
        self._fill(wait_ms if self._in_flight is None else None)
        decision = self._decide()
        self.apply(decision)
        if decision.run:
            return None  # more may be ready: look again without blocking
        if decision.wait_s is not None:
            return min(MAX_BLOCK_MS, int(decision.wait_s * 1000)) or None
        return MAX_BLOCK_MS

    def _decide(self) -> BatchDecision:
        """The scheduler's decision; while a batch computes, whether to prepare the next.

        A batch is prepared ahead only when the scheduler would send it as
        soon as the device is free for a reason that more waiting cannot
        change: it is full, or holds urgent work or a deadline. It is decided
        for the time the batch on the device is expected to end. Otherwise
        (an underfull batch that waited long enough) the batch on the device
        is landed first and the decision taken again, with what arrived
        meanwhile. Jobs are expired only against the real clock.
        """
        items = self._items()  # landing a batch changes nothing pending
        flight = self._in_flight
        if flight is not None:
            ahead = self.policy(items, max(self.clock(), flight.ends_s))
            if ahead.run and ahead.trigger in AHEAD_TRIGGERS:
                return dataclasses.replace(ahead, expire=())
            self._land()
        return self.policy(items, self.clock())

    @property
    def version(self) -> int | None:
        """The version of the model this worker runs new batches on."""
        return self.recorder.model_version

    def _follow_version(self) -> None:
        """Switch to a version the manager has loaded; settle jobs pinned to one not served."""
        if self.versions is not None:
            loaded = self.versions.poll()
            if loaded is not None:
                self._switch(loaded)
            elif (
                self.versions.restart_for is not None
                and not self.restart_requested
                and self.versions.take_restart_turn()
            ):
                log.info(
                    "restarting to load another version alone",
                    extra={"model": self.model, "version": self.versions.restart_for},
                )
                self.restart_requested = True
                self.request_stop()  # drains: the batch on the device is recorded first
        self._settle_unserved_pins()

    def _switch(self, loaded: Loaded) -> None:
        """New batches run on ``loaded`` from now on.

        The batch on the device (launched ahead) is landed first with the
        runtime that launched it, so every batch runs, and is recorded as
        run, by one version. Jobs claimed from now on record the new one,
        and the scheduler prices batches with what the new runtime measured.
        """
        assert self.versions is not None
        self._land()
        self.runtime = loaded.runtime
        self.recorder.model_version = loaded.version
        self._ahead = self._launch_ahead and loaded.runtime.asynchronous
        if loaded.prepared is not None:
            self.state, self.policy = loaded.prepared
        old = self.versions.switched(loaded)
        # Its batches are all landed: nothing holds the old runtime once this returns.
        self.versions.unloaded(old)

    def _settle_unserved_pins(self) -> None:
        """Fail jobs pinned to a version this worker neither serves nor is going to serve."""
        now = time.monotonic()
        if now - self._pins_checked < PIN_CHECK_S:
            return  # a pass over everything pending: not every step
        self._pins_checked = now
        if not any(self._unserved_pin(e) for e in self.pending.values()):
            return
        if self.versions is not None:
            # Read the activation afresh first: the API may have seen it before this worker.
            loaded = self.versions.poll(now=True)
            if loaded is not None:
                self._switch(loaded)
        unserved = [key for key, e in self.pending.items() if self._unserved_pin(e)]
        if not unserved:
            return
        entries = [self.pending.pop(key) for key in unserved]
        active = self.versions.wanted if self.versions is not None else self.version
        outcomes = [
            Outcome(
                e.message.job_id,
                "failed",
                error=f"version {e.message.version} of {self.model} is not served now "
                f"(the active version is {active}; serving {self.version})",
            )
            for e in entries
        ]
        written = self._record(outcomes, _utc(self.clock()), None, None, entries)
        self._acknowledge(entries, written)

    def _unserved_pin(self, entry: Entry) -> bool:
        """A job pinned to a version other than the one served, and not the one being loaded."""
        pin = entry.message.version
        if pin is None or pin == self.version:
            return False
        manager = self.versions
        # A job pinned to the version being loaded waits for it, unless its load failed.
        return manager is None or pin != manager.wanted or manager.failed(pin)

    def _retrying(self, stop: threading.Event, action: Callable[[], None]) -> None:
        backoff_s = RETRY_MIN_S
        while not stop.is_set():
            try:
                action()
                return
            except redis.RedisError as exc:
                log.warning("redis unavailable; retrying",
                            extra={"error_type": type(exc).__name__})  # fmt: skip
                stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, RETRY_MAX_S)

    def _upkeep(self) -> None:
        """Keep held entries ours, and take over those a dead worker left behind."""
        now = time.monotonic()
        if now - self._last_upkeep < max(0.5, self.visibility_timeout_s / 4):
            return
        self._last_upkeep = now
        for entry in self.consumer.touch(list(self.pending.values())):
            # Another worker took it over while this one stalled: it is theirs now.
            self.pending.pop(_key(entry), None)
        room = self.prefetch - len(self.pending)
        if room <= 0:
            return
        reclaimed = self.consumer.reclaim(int(self.visibility_timeout_s * 1000), room)
        self.metrics.reclaimed(len(reclaimed))
        self._take(reclaimed)

    def _fill(self, block_ms: int | None) -> None:
        room = self.prefetch - len(self.pending)
        if room <= 0:
            # Nothing may be read: wait as the policy asked rather than spin.
            if block_ms:
                time.sleep(block_ms / 1000.0)
            return
        self._take(self.consumer.read(room, block_ms))

    def _take(self, entries: list[Entry]) -> None:
        """Hold entries read, except those already held (a re-read returns them again)."""
        for entry in entries:
            key = _key(entry)
            if key not in self.pending and key not in self._running:
                self.pending[key] = entry
                self.state.observe_arrival(entry.message.cost, entry.message.lane, self.clock())

    def _items(self) -> list[PendingItem]:
        return [
            PendingItem(
                key=key,
                lane=e.message.lane,
                cost=e.message.cost,
                arrival_s=e.message.enqueued_at_ms / 1000.0,
                deadline_s=(e.message.deadline_at_ms / 1000.0)
                if e.message.deadline_at_ms is not None
                else None,
                tenant=e.message.tenant or "",
                last_served=self._served.get(e.message.tenant or "", -1),
            )
            for key, e in self.pending.items()
            if e.message.version is None or e.message.version == self.version
        ]

    def _mark_served(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._served[entry.message.tenant or ""] = self._batches
        self._batches += 1
        if len(self._served) > 2 * len(self.pending) + 1000:
            # Forget tenants with nothing pending: they come back as never served.
            waiting = {e.message.tenant or "" for e in self.pending.values()}
            self._served = {t: n for t, n in self._served.items() if t in waiting}

    def apply(self, decision: BatchDecision) -> None:
        if decision.expire:
            self._expire([self.pending.pop(item.key) for item in decision.expire])
        if decision.run:
            batch = [self.pending.pop(item.key) for item in decision.run]
            self._running.update(_key(entry) for entry in batch)
            self._mark_served(batch)
            self._run_batch(batch, decision)

    def _expire(self, entries: list[Entry]) -> None:
        written = self._settle_unrunnable(
            [e.message.job_id for e in entries], [], "the deadline cannot be met"
        )
        self._acknowledge(entries, written)
        log.info("jobs expired", extra={"model": self.model, "count": len(written)})

    def _run_batch(self, entries: list[Entry], decision: BatchDecision) -> None:
        started = (
            self.recorder.started_before([e.message.job_id for e in entries])
            if len(entries) > 1
            else set()
        )
        self.state.batch_started()
        if not started:
            self._run_group(entries, decision, ahead=self._ahead)
            return
        self._land()  # a suspect runs with nothing else on the device
        # A job started before and never finished may be what killed a worker:
        # each such job runs alone, so it cannot take its batch mates down (and
        # use up their attempts) with it.
        fresh = [e for e in entries if e.message.job_id not in started]
        groups = ([fresh] if fresh else []) + [[e] for e in entries if e.message.job_id in started]
        for number, group in enumerate(groups):
            if number and self._stop.is_set():
                # Stopping: what has not run stays unacknowledged, for the next worker.
                return
            # A suspect may kill the process: what ran before it is recorded first.
            self.wait_recorded()
            self.consumer.touch([e for g in groups[number:] for e in g])
            self._run_group(group, decision)

    def _run_group(
        self, entries: list[Entry], decision: BatchDecision, ahead: bool = False
    ) -> None:
        batch_id = str(uuid.uuid4())
        by_job = {e.message.job_id: e for e in entries}
        claimed, late, exhausted = self.recorder.claim(
            list(by_job), _utc(self.clock()), self.max_attempts
        )
        written = self._settle_unrunnable(
            late, [by_job[job_id] for job_id in exhausted], "the deadline passed before it started"
        )
        costs = [by_job[job.job_id].message.cost for job in claimed]
        self.metrics.started([by_job[job.job_id].message for job in claimed], self.clock())
        started = time.perf_counter()
        events = self.events if claimed else None
        if events is not None:
            lanes = [by_job[job.job_id].message.lane for job in claimed]
            events.batch_started(batch_id, len(claimed), sum(costs), lanes, decision.predicted_s)
        flight = _InFlight(batch_id, entries, claimed, costs, written, decision, started, ahead)
        if claimed:
            self._launch(flight)
            if not ahead:
                self._land()  # prepared, launched and collected one after the other
            return
        self._land()
        self._hand_over(self._finisher(flight, self._compute(batch_id, entries, claimed, costs)))

    def _launch(self, flight: _InFlight) -> None:
        """Prepare this batch while the one before computes; launch it once that one is done.

        Preparing or launching may raise (an image that does not decode, the
        device out of memory): the batch is then run input by input when it
        is landed, so only the inputs at fault fail. A worker that dies while
        a batch computes has claimed the next one too: those jobs count it as
        an attempt and run alone next time, like the batch's own.
        """
        inputs = [job.input for job in flight.claimed]
        prepared = None
        flight.began = time.perf_counter()
        try:
            prepared = self.runtime.prepare(inputs)
        except Exception as exc:
            flight.failed = exc
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            previous.wait()
            if previous.failed is not None:
                # It runs again input by input (or halved) with nothing else on
                # the device, so that what it teaches (a lower memory ceiling)
                # and the peaks measured belong to it alone.
                self._land_batch(previous)
                previous = None
        if prepared is not None:
            try:
                flight.launched = self.runtime.launch(prepared)
            except Exception as exc:
                flight.failed = exc
        flight.ends_s = self.clock() + flight.decision.predicted_s
        self._in_flight = flight
        if previous is not None:
            self._land_batch(previous)  # while this one computes
        if flight.failed is not None:
            self._land()  # the same, at once: the device is idle

    def _land(self) -> None:
        """Wait for the batch on the device, if there is one, and hand it over to be recorded."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            flight.wait()
            self._land_batch(flight)

    def _land_batch(self, flight: _InFlight) -> None:
        try:
            computed = self._collect(flight)
        except BaseException as exc:
            self._batch_failed(self.events, flight.batch_id, flight.started,
                               len(flight.claimed), exc)  # fmt: skip
            raise
        self._hand_over(self._finisher(flight, computed))

    def _collect(self, flight: _InFlight) -> _Computed:
        """A launched batch's outputs; one that raised is run again, isolating the culprits."""
        inputs = [job.input for job in flight.claimed]
        launched, failed = flight.launched, flight.failed
        if launched is not None and failed is None:
            try:
                outputs = check_outputs(self.runtime.collect(launched), inputs)
            except Exception as exc:
                failed = exc
            else:
                # Launched ahead, its preparation overlapped the batch before:
                # its latency is the device's. Otherwise it is the whole run.
                batch_s = launched.device_s if flight.ahead else time.perf_counter() - flight.began
                results = [
                    ItemResult(ok=True, output=output, inference_ms=batch_s * 1000.0)
                    for output in outputs
                ]
                return self._learned(
                    flight.entries, flight.claimed, flight.costs, results,
                    batch_s, launched.peak_memory_bytes, 0, device_s=launched.device_s,
                )  # fmt: skip
        return self._compute(
            flight.batch_id, flight.entries, flight.claimed, flight.costs, failed=failed
        )

    def _finisher(self, flight: _InFlight, computed: _Computed) -> Callable[[], None]:
        return functools.partial(
            self._finish, flight.batch_id, flight.entries, flight.claimed, flight.costs,
            flight.written, flight.decision, computed, flight.started,
        )  # fmt: skip

    def _batch_failed(
        self, events: BatchEvents | None, batch_id: str, started: float, size: int,
        exc: BaseException,
    ) -> None:  # fmt: skip
        if events is not None:
            # Its jobs were not recorded: they stay pending and run again in another batch.
            events.batch_finished(
                batch_id, time.perf_counter() - started, size, size,
                error=f"{type(exc).__name__} while running or recording it "
                "(jobs not acknowledged run again)",
            )  # fmt: skip

    def _hand_over(self, finish: Callable[[], None]) -> None:
        """Record the batch now, or, pipelined, on the recording thread while the next one runs.

        One batch at most is being recorded while another computes: before
        handing over, the previous recording must be done, and an error it
        raised (the database gone) is raised here, in the loop.
        """
        if self._recording is None:
            finish()
            return
        try:
            self.wait_recorded()
        finally:
            # Recorded even when the previous recording failed: this batch ran,
            # and its own recording may well succeed (the loop then waits for
            # it before reading the streams again).
            self._recorded = self._recording.submit(finish)

    def _settle_recording(self) -> None:
        """Land the batch on the device and wait for the one being recorded.

        A failure leaves the batch's entries unacknowledged: its jobs run again.
        A lost device is raised once what was computed before it is recorded.
        """
        lost = None
        for settle in (self._land, self.wait_recorded):
            try:
                settle()
            except DeviceLost as exc:
                lost = exc
            except (redis.RedisError, SQLAlchemyError) as exc:
                log.warning(
                    "a batch's results were not recorded; its jobs run again",
                    extra={"model": self.model, "error_type": type(exc).__name__},
                )
            except Exception:
                log.exception(
                    "recording a batch failed; its jobs run again", extra={"model": self.model}
                )
        if lost is not None:
            raise lost

    def wait_recorded(self) -> None:
        """Until the batch being recorded is; re-raises what its recording raised."""
        if self._recorded is not None:
            recorded, self._recorded = self._recorded, None
            recorded.result()

    def _compute(
        self,
        batch_id: str,
        entries: list[Entry],
        claimed: list[Claimed],
        costs: list[int],
        failed: Exception | None = None,
    ) -> _Computed:
        """Run the claimed jobs and learn from the batch (what the scheduler needs next).

        ``failed``: what the whole batch raised when it was launched ahead.
        """
        ooms = 0

        def out_of_memory(start: int, end: int) -> None:
            nonlocal ooms
            ooms += 1
            self.state.observe_oom(self._work(costs[start:end]))
            log.warning(
                "out of memory; memory ceiling lowered",
                extra={"model": self.model, "batch_id": batch_id, "size": end - start,
                       "memory_ceiling_bytes": round(self.state.memory_ceiling)},
            )  # fmt: skip

        began = time.perf_counter()
        results = run_isolating(
            self.runtime.run, [c.input for c in claimed], on_oom=out_of_memory, failed=failed
        )
        batch_s = time.perf_counter() - began
        peak = self.runtime.peak_memory_bytes
        return self._learned(entries, claimed, costs, results, batch_s, peak, ooms)

    def _learned(
        self,
        entries: list[Entry],
        claimed: list[Claimed],
        costs: list[int],
        results: list[ItemResult],
        batch_s: float,
        peak: float | None,
        ooms: int,
        device_s: float | None = None,
    ) -> _Computed:
        """Tell the scheduler and the metrics how the batch went.

        ``batch_s``: the batch's latency as the scheduler plans it (what it
        kept the next batch waiting); ``device_s``: the device's busy time.
        """
        by_job = {e.message.job_id: e for e in entries}
        self.metrics.computed(batch_s if device_s is None else device_s)
        computed_at = self.clock()
        eff = efficiency(costs)
        if claimed:
            self._learn(
                BatchObservation(
                    size=len(claimed),
                    cost=sum(costs),
                    work=self._work(costs),
                    latency_s=batch_s,
                    ended_s=computed_at,
                    job_latency_s=[
                        computed_at - by_job[job.job_id].message.enqueued_at_ms / 1000.0
                        for job in claimed
                    ],
                    peak_memory_bytes=peak,
                    lanes=[by_job[job.job_id].message.lane for job in claimed],
                    split=ooms > 0 or any(not r.ok for r in results),
                ),
                eff,
            )
        return _Computed(results, batch_s, eff, peak, self.state.window_s)

    def _finish(
        self,
        batch_id: str,
        entries: list[Entry],
        claimed: list[Claimed],
        costs: list[int],
        written: list[str],
        decision: BatchDecision,
        computed: _Computed,
        started: float,
    ) -> None:
        """Record the outcomes, acknowledge, and tell the metrics, the log and Flower."""
        events = self.events if claimed else None
        results = computed.results
        failed = sum(1 for r in results if not r.ok)
        try:
            outcomes = [
                Outcome(
                    job.job_id,
                    "succeeded" if result.ok else "failed",
                    output=result.output,
                    error=result.error,
                    inference_ms=result.inference_ms,
                )
                for job, result in zip(claimed, results, strict=True)
            ]
            written = written + self._record(
                outcomes, _utc(self.clock()), batch_id, len(claimed) or None, entries
            )
            self._acknowledge(entries, written, batch_id)
        except BaseException as exc:
            self._batch_failed(events, batch_id, started, len(claimed), exc)
            raise
        self.metrics.batch(
            costs, computed.batch_s, decision.predicted_s, computed.efficiency,
            computed.window_s, computed.peak_memory_bytes,
        )  # fmt: skip
        log.info(
            "batch done",
            extra={
                "model": self.model,
                "batch_id": batch_id,
                "size": len(claimed),
                "cost": sum(costs),
                "efficiency": round(computed.efficiency, 3),
                "lanes": sorted({e.message.lane for e in entries}),
                "batch_ms": round(computed.batch_s * 1000.0, 2),
                "predicted_ms": round(decision.predicted_s * 1000.0, 2),
                "trigger": decision.trigger,
                "failed": failed,
            },
        )
        if events is not None:
            events.batch_finished(batch_id, time.perf_counter() - started, len(claimed), failed)

    def _work(self, costs: list[int]) -> float:
        if not costs:
            return 0.0
        return len(costs) * max(costs) if self.state.tuning.padded else float(sum(costs))

    def _settle_unrunnable(self, late: list[str], exhausted: list[Entry], why: str) -> list[str]:
        """Record the jobs a batch will not run: past their deadline, or out of attempts."""
        outcomes = [Outcome(job_id, "expired", error=why) for job_id in late]
        if exhausted:
            self.consumer.dead_letter(exhausted)
            self.metrics.dead_lettered(e.message for e in exhausted)
            outcomes += [
                Outcome(
                    e.message.job_id,
                    "failed",
                    error=f"gave up after {self.max_attempts} attempts "
                    "(the worker stopped while running it each time)",
                )
                for e in exhausted
            ]
        return self._record(outcomes, _utc(self.clock()), None, None, exhausted)

    def _record(
        self,
        outcomes: list[Outcome],
        now: dt.datetime,
        batch_id: str | None,
        batch_size: int | None,
        entries: list[Entry],
    ) -> list[str]:
        """Write the outcomes; remember what was written, for the metrics."""
        written = self._write(outcomes, now, batch_id, batch_size, entries)
        done = set(written)
        for outcome in outcomes:
            if outcome.job_id in done:
                self._written_status[outcome.job_id] = outcome.status
        return written

    def _write(
        self,
        outcomes: list[Outcome],
        now: dt.datetime,
        batch_id: str | None,
        batch_size: int | None,
        entries: list[Entry],
    ) -> list[str]:
        """Write the outcomes; one the database refuses to store fails on its own."""
        try:
            return self._durably(
                lambda: self.recorder.finish(outcomes, now, batch_id, batch_size), entries
            )
        except StatementError as exc:
            if isinstance(exc, (OperationalError, InterfaceError)):
                raise  # unreachable past the drain time: leave it unacknowledged
            if len(outcomes) == 1:
                log.error(
                    "result could not be stored; the job fails",
                    extra={"model": self.model, "job_id": outcomes[0].job_id,
                           "error_type": type(exc).__name__},
                )  # fmt: skip
                failed = Outcome(
                    outcomes[0].job_id,
                    "failed",
                    error=f"the result could not be stored ({type(exc).__name__})",
                )
                return self._durably(
                    lambda: self.recorder.finish([failed], now, batch_id, batch_size), entries
                )
            written: list[str] = []
            for outcome in outcomes:
                written += self._write([outcome], now, batch_id, batch_size, entries)
            return written

    def _durably(self, write: Callable[[], list[str]], entries: list[Entry]) -> list[str]:
        """Retry a result write while the database is unreachable; acknowledge nothing meanwhile.

        Only connection failures are retried (a value the database refuses is
        not going to be stored by trying again). The entries are kept ours
        while waiting. A stopping worker gives up ``drain_s`` after the stop was
        asked for: its entries stay unacknowledged and are run again.
        """
        backoff_s = RETRY_MIN_S
        while True:
            try:
                return write()
            except (OperationalError, InterfaceError, PoolTimeout) as exc:
                left_s = self._drain_left_s()
                if left_s is not None and left_s <= 0:
                    raise
                log.warning(
                    "database unavailable; retrying the result write",
                    extra={"model": self.model, "error_type": type(exc).__name__,
                           "retry_in_s": backoff_s},
                )  # fmt: skip
                self._stop.wait(backoff_s if left_s is None else min(backoff_s, left_s))
                backoff_s = min(backoff_s * 2, RETRY_MAX_S)
                with contextlib.suppress(redis.RedisError):
                    self.consumer.touch(entries)

    def request_stop(self) -> None:
        """Stop after the current batch (a signal handler calls this)."""
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
        self.ready.clear()  # draining: /readyz says so at once
        self._stop.set()

    def _drain_left_s(self) -> float | None:
        """Seconds left to finish after a stop was asked for (None: not stopping)."""
        if not self._stop.is_set():
            return None
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
        return self._stop_requested_at + self.drain_s - time.monotonic()

    def _acknowledge(
        self, entries: list[Entry], written: list[str], batch_id: str | None = None
    ) -> None:
        # The long-polls of the finished jobs are woken in the same round trip.
        done = (done_channel(self.prefix), ",".join(written)) if written else None
        self.consumer.ack(entries, publish=done)
        self._running.difference_update(_key(entry) for entry in entries)
        by_job = {e.message.job_id: e.message for e in entries}
        for job_id in written:
            message = by_job.get(job_id)
            # A request's X-Request-ID follows its job here (backfill items have
            # none: their batches are logged whole).
            if message is not None and message.request_id:
                log.info(
                    "job finished",
                    extra={"job_id": job_id, "request_id": message.request_id,
                           "batch_id": batch_id, "model": self.model, "lane": message.lane,
                           "status": self._written_status.get(job_id)},
                )  # fmt: skip
        self.metrics.finished(
            (
                (by_job[job_id], self._written_status.pop(job_id, "succeeded"))
                for job_id in written
                if job_id in by_job
            ),
            self.clock(),
        )
        # Webhooks go out only after the results are committed and acknowledged.
        deliveries = self.recorder.take_outbox()
        if deliveries and self.kick is not None:
            self.kick(deliveries)

    def _learn(self, seen: BatchObservation, eff: float) -> None:
        self.state.observe_batch(seen)
        self.stats.add(seen.size, seen.cost, seen.work, seen.latency_s * 1000.0, eff)
        if time.monotonic() - self._published_at < PUBLISH_S:
            self._unpublished = True  # the heartbeat publishes it once PUBLISH_S has passed
            return
        try:
            self._publish()
        except redis.RedisError as exc:
            # Advisory (estimates for the API): the batch is recorded all the same,
            # and the next batch publishes again.
            log.warning(
                "learned figures not published",
                extra={"model": self.model, "error_type": type(exc).__name__},
            )

    def _publish(self) -> None:
        """What this worker has learned, for /v1/models and the API's wait estimates."""
        stats = self.stats
        estimate = estimate_of(
            self.state,
            stats.mean_cost,
            stats.pad_ratio if self.state.tuning.padded else 1.0,
        )
        mapping = estimate.to_hash()
        if stats.batches:
            mapping |= {
                "avg_batch_ms": f"{stats.avg_batch_ms:.3f}",
                "avg_batch_size": f"{stats.avg_batch_size:.3f}",
                "efficiency": f"{stats.efficiency:.4f}",
            }
        self.client.hset(stats_key(self.prefix, self.model), mapping=mapping)  # type: ignore[arg-type]
        self._published_at = time.monotonic()
        self._unpublished = False

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if self._unpublished and now - self._published_at >= PUBLISH_S:
            # The last batches of a burst, learned while publishing was held back.
            with contextlib.suppress(redis.RedisError):
                self._publish()
        if now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        key = workers_key(self.prefix, self.model)
        wall = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(key, {self.consumer.consumer: wall})
        # Workers that died without saying so: forget them after a while.
        pipe.zremrangebyscore(key, "-inf", wall - 30 * HEARTBEAT_TTL_S)
        pipe.execute()


@dataclass
class _InFlight:
    """A claimed batch on its way through the device, until it is handed over to be recorded."""

    batch_id: str
    entries: list[Entry]
    claimed: list[Claimed]
    costs: list[int]
    written: list[str]  # jobs of its entries settled without running (late, out of attempts)
    decision: BatchDecision
    started: float  # perf_counter when it was claimed
    ahead: bool = False  # prepared while the batch before computed
    began: float = 0.0  # perf_counter when its preparation began
    launched: Launched | None = None
    failed: Exception | None = None  # what preparing, launching or the device raised
    ends_s: float = 0.0  # when the scheduler expects it done (the loop's clock)

    def wait(self) -> None:
        """Until the device is done with it; what the device raised is kept for landing."""
        if self.launched is not None and self.failed is None:
            try:
                self.launched.wait()
            except Exception as exc:
                self.failed = exc


@dataclass(frozen=True)
class _Computed:
    """A batch run and not yet recorded."""

    results: list[ItemResult]
    batch_s: float
    efficiency: float
    peak_memory_bytes: float | None
    window_s: float | None


def _key(entry: Entry) -> str:
    return entry.entry_id + "@" + entry.stream


def _utc(epoch_s: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC)
