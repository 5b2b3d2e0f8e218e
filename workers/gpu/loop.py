"""The loop of an encoder's worker: one batch a step, through a few named parts.

Each step (:class:`~workers.gpu.worker_loop.WorkerLoop`) reads
(:class:`~workers.gpu.intake.Intake`), asks the scheduler
(:class:`~scheduler.Batcher`) what to do, and applies the decision: expired
jobs are recorded, a batch is claimed and sent through the device
(:class:`~workers.gpu.device.DevicePipeline`), and what the device landed
is reported to the scheduler, here and only here, then recorded
(:class:`~workers.gpu.recording.Recording`). An encoder batch is a step
that prefills and finishes everything it holds. Metrics, logs, Flower and
webhooks observe the batches (:mod:`workers.gpu.events`). The loop never
decides itself; an entry is acknowledged only after its job's outcome is
committed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import OutOfMemoryError

from backends.base import DeviceLost, Runtime
from scheduler import BatchDecision, Batcher
from scheduler.learning import BatchObservation, SchedulerState
from workers.gpu.consumer import Entry, StreamConsumer
from workers.gpu.device import Computed, DevicePipeline, InFlight
from workers.gpu.events import BatchFinished, BatchLog, BatchObserver, BatchStarted, Observers
from workers.gpu.executions import ExecutionLog
from workers.gpu.intake import Intake, entry_key
from workers.gpu.learned import LoopStats, Publisher
from workers.gpu.observe import Metrics
from workers.gpu.probation import Probation, Verdict
from workers.gpu.recorder import Claimed, Outcome, Recorder
from workers.gpu.recording import Drain, Recording, acknowledge_failed, utc_at
from workers.gpu.versions import Loaded, VersionManager
from workers.gpu.worker_loop import MAX_BLOCK_MS, OUTAGES, WorkerLoop

log = logging.getLogger(__name__)

# How often jobs pinned to a version no longer served are looked for.
PIN_CHECK_S = 0.5


@dataclass(frozen=True)
class LoopConfig:
    """How a worker runs its batches (``Settings.section``: the settings of the same names)."""

    prefetch: int = 128
    max_attempts: int = 3
    visibility_timeout_s: float = 120.0
    worker_drain_s: float = 30.0
    pipeline: bool = False  # record batch N while batch N + 1 runs
    pipeline_prepare: bool = False  # prepare batch N + 1 while batch N computes
    execution_log_dir: Path | None = None  # where computed batches are recorded (tests)
    rollback_after_failed_batches: int = 3  # a new version's whole-failed batches (0: never)


# While a batch computes, the next one's decision waits until HOLD_MARGIN times the
# measured time to decide and prepare a batch, plus HOLD_FLOOR_S, before its predicted
# end, checking every HOLD_SLICE_S whether the device finished sooner.
HOLD_MARGIN = 2.0
HOLD_FLOOR_S = 0.001
HOLD_SLICE_S = 0.001


@dataclass
class BatchPlan:
    """A step of an encoder: the scheduler's decision, or the batch on the device to land.

    ``decision`` None: a batch computes and the scheduler would not send the
    next one before it is done; the step lands it, and the next step decides
    with what arrived meanwhile. ``batch``: the entries the decision takes,
    once :meth:`BatchLoop.start` has taken them from the scheduler.
    """

    decision: BatchDecision | None
    batch: list[Entry] = field(default_factory=list)


@dataclass(frozen=True)
class Landed:
    """A batch the device is done with, reported to the scheduler, to be recorded."""

    flight: InFlight
    computed: Computed
    window_s: float | None  # the scheduler's window when it landed (what the observers see)


class BatchLoop(WorkerLoop[BatchPlan, list[tuple[InFlight, Computed]], list[Landed]]):
    """One worker: ``runtime`` runs the batches ``batcher`` decides on what ``consumer`` reads."""

    def __init__(
        self,
        *,
        runtime: Runtime,
        consumer: StreamConsumer,
        recorder: Recorder,
        batcher: Batcher[Entry],
        client: redis.Redis,
        prefix: str,
        config: LoopConfig = LoopConfig(),
        observers: list[BatchObserver] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock)
        self.consumer = consumer
        self.recorder = recorder
        self.batcher = batcher
        self.client = client
        self.config = config
        model = consumer.model
        # Metrics and the log always watch; Flower and webhooks when the process adds them.
        self.observers = Observers(Metrics(model, runtime.device), BatchLog(model))
        for observer in observers or ():
            self.observers.add(observer)
        self.drain = Drain(config.worker_drain_s)
        self.intake = Intake(
            consumer,
            batcher,
            self.observers,
            prefetch=config.prefetch,
            visibility_timeout_s=config.visibility_timeout_s,
            clock=clock,
        )
        self.device = DevicePipeline(
            model, runtime, self.observers, launch_ahead=config.pipeline_prepare, clock=clock
        )
        # With launch-ahead, how long reading, deciding and preparing a batch takes (the
        # longest lately: a maximum that decays; None until measured), and when the read
        # before the step's decision began.
        self._prepare_s: float | None = None
        self._deciding = 0.0
        self.recording = Recording(
            model,
            recorder,
            self.intake,
            self.observers,
            self.drain,
            prefix=prefix,
            max_attempts=config.max_attempts,
            pipeline=config.pipeline,
            clock=clock,
        )
        self.publisher = Publisher(client, prefix, model, consumer.consumer, clock)
        self.executions = (
            ExecutionLog(config.execution_log_dir, consumer.consumer)
            if config.execution_log_dir is not None
            else None
        )
        # The model's own settings from its model.toml (what Flower's conf shows).
        self.model_settings: dict[str, Any] = {}
        # Hot reload: when set, the loop switches to the versions it loads.
        self.versions: VersionManager | None = None
        # A version switched to, on trial until it computes a job (workers.gpu.probation).
        self.probation: Probation | None = None
        self._pins_checked = 0.0

    @property
    def runtime(self) -> Runtime:
        return self.device.runtime

    @property
    def state(self) -> SchedulerState:
        return self.batcher.state

    @property
    def stats(self) -> LoopStats:
        return self.publisher.stats

    @property
    def prefetch(self) -> int:
        """The most entries held at once."""
        return self.intake.prefetch

    @prefetch.setter
    def prefetch(self, value: int) -> None:
        self.intake.prefetch = value

    @property
    def pending(self) -> dict[str, Entry]:
        """The entries held and not yet in a batch, by key (a copy: on the loop's thread only)."""
        return self.batcher.pending()

    @property
    def held_count(self) -> int:
        return len(self.batcher)

    @property
    def version(self) -> int | None:
        """The version of the model this worker runs new batches on."""
        return self.recorder.model_version

    # --- running ---------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.drain.stop = stop  # a stop asked for starts the drain time of recordings
        super().run(stop)

    def join(self) -> None:
        self.consumer.ensure_groups()
        # Redis at its maxmemory refuses the figures, not the reads and acknowledgements
        # that free memory: a worker started then must not wait for a room it makes.
        with contextlib.suppress(OutOfMemoryError):
            self.publisher.publish(self.state)

    def begin(self) -> None:
        if self.versions is not None:
            self.versions.start()

    def forget(self) -> None:
        self._settle_recording()
        if self.probation is not None:
            self.probation.held.clear()  # read again with the rest: run once, from there
        self.intake.reread()

    def close(self) -> None:
        lost = None
        try:
            self._settle_recording()  # the last batch's results are written before it stops
        except DeviceLost as exc:
            lost = exc
        self.recording.close()
        if self.executions is not None:
            self.executions.close()
        if self.versions is not None:
            self.versions.stop()
        if lost is not None:
            raise lost

    # --- a step ----------------------------------------------------------------

    def upkeep(self) -> None:
        if self.versions is not None:
            self.versions.collect_dropped()
        if self.recording.done_recording():
            self.recording.wait()  # a recording that failed is heard of now, even when idle
        self.publisher.beat(self.state)
        self.intake.upkeep()
        self._judge_version()
        self._follow_version()

    def read(self, block_ms: int | None) -> None:
        flight = self.device.in_flight
        if flight is None:
            self.intake.fill(block_ms)
            self._deciding = time.perf_counter()
            return
        # While a batch computes, the next is decided as late as its preparation allows:
        # a job that arrives before then rides in it, where one decided as soon as the
        # batch launched would leave it waiting a batch more (the device is not idle
        # for it: the next is still prepared before this one ends).
        self._hold(flight)
        self._deciding = time.perf_counter()
        self.intake.fill(None)  # what is there already: the batch is landed next

    def _hold(self, flight: InFlight) -> None:
        """Until the device is done with ``flight`` or the next batch's preparation (its
        decision, claim and inputs, as measured) must begin for it to be ready then."""
        if self._prepare_s is None:
            return
        until = flight.ends_s - (HOLD_MARGIN * self._prepare_s + HOLD_FLOOR_S)
        while not flight.done() and not self.drain.stop.is_set():
            left = until - self.clock()
            if left <= 0:
                return
            time.sleep(min(left, HOLD_SLICE_S))

    def schedule(self, now: float) -> BatchPlan:
        """The scheduler's decision; while a batch computes, whether to prepare the next.

        A batch is prepared ahead only when the scheduler would send it as
        soon as the device is free for a reason that more waiting cannot
        change; otherwise this step lands the batch on the device, and the
        next decides again, with what arrived meanwhile.
        """
        flight = self.device.in_flight
        if flight is None:
            return BatchPlan(self.batcher.schedule(now, runnable=self._runnable))
        if self.state.urgent_about(now):
            # Urgent work comes and goes: the next batch is decided once the device is free,
            # with what arrived by then, so that an urgent job waits for one batch at most
            # rather than for the one decided ahead too (the overlap of its preparation is
            # what that costs, while urgent traffic lasts).
            return BatchPlan(None)
        ahead = self.batcher.schedule(now, busy_until=flight.ends_s, runnable=self._runnable)
        return BatchPlan(ahead if ahead.run else None)

    def _runnable(self, entry: Entry) -> bool:
        """A job pinned to another version waits (or is failed by the pin check)."""
        pin = entry.message.version
        return pin is None or pin == self.version

    def start(self, plan: BatchPlan) -> None:
        decision = plan.decision
        if decision is None:
            return
        if decision.expire:
            self.recording.expire(self.batcher.expired(decision))
        if decision.run:
            plan.batch = self.batcher.started(decision)
            self.intake.started(plan.batch)

    def execute(self, plan: BatchPlan) -> list[tuple[InFlight, Computed]]:
        if plan.decision is None:
            self.device.land()
        elif plan.batch:
            self._run_batch(plan.batch, plan.decision)
        return self.device.take_landed()

    def update_from_output(
        self, plan: BatchPlan | None, output: list[tuple[InFlight, Computed]]
    ) -> list[Landed]:
        """What each landed batch taught the scheduler (its latency, its memory, any
        out-of-memory), reported in the order the batches landed."""
        landed = []
        for flight, computed in output:
            for costs in computed.out_of_memory:
                self.batcher.out_of_memory(list(costs))
                log.warning(
                    "out of memory; memory ceiling lowered",
                    extra={
                        "model": self.model,
                        "batch_id": flight.batch_id,
                        "size": len(costs),
                        "memory_ceiling_bytes": round(self.state.memory_ceiling),
                    },
                )
            self.observers.batch_computed(computed.device_s)
            if flight.claimed and self.probation is not None:
                if self.probation.judge(flight, computed) is not Verdict.PASS:
                    continue  # held: neither learned from nor recorded until the trial ends
                landed += self._kept(self.probation)
            if flight.claimed:
                self._learn(flight, computed)
            landed.append(Landed(flight, computed, self.state.window_s))
        return landed

    def _kept(self, trial: Probation) -> list[Landed]:
        """The version on trial computed a job: the batches it failed whole failed on their
        inputs (recorded as they came), and the version it replaced is dropped."""
        landed = []
        for held, computed in trial.ended():
            self._learn(held, computed)
            landed.append(Landed(held, computed, self.state.window_s))
        if self.versions is not None:
            self.versions.unloaded(trial.previous)
        self.probation = None
        return landed

    def _learn(self, flight: InFlight, computed: Computed) -> None:
        at_s = self.clock()
        enqueued = {e.message.job_id: e.message for e in flight.entries}
        seen = BatchObservation(
            size=len(flight.claimed),
            cost=sum(flight.costs),
            work=self.batcher.work(flight.costs),
            latency_s=computed.batch_s,
            ended_s=at_s,
            job_latency_s=[
                at_s - enqueued[job.job_id].enqueued_at_ms / 1000.0 for job in flight.claimed
            ],
            peak_memory_bytes=computed.peak_memory_bytes,
            lanes=[enqueued[job.job_id].lane for job in flight.claimed],
            split=computed.split,
        )
        self.batcher.finished(seen)
        self.publisher.learned(self.state, seen, computed.efficiency)
        if self.executions is not None:
            # Before the outcomes are written: the record must not depend on that write.
            self.executions.append(
                flight.batch_id, [(job.job_id, job.attempts) for job in flight.claimed]
            )

    def apply(self, events: list[Landed]) -> None:
        """Hand each landed batch over to be recorded (on the recording thread, pipelined)."""
        for landed in events:
            self.recording.hand_over(
                functools.partial(self._finish, landed.flight, landed.computed, landed.window_s)
            )

    def ran(self, plan: BatchPlan) -> bool:
        return bool(plan.batch)

    def next_wait_ms(self, plan: BatchPlan) -> int | None:
        decision = plan.decision
        if decision is None or decision.run:
            return None  # more may be ready: look again without blocking
        if decision.wait_s is not None:
            return min(MAX_BLOCK_MS, int(decision.wait_s * 1000)) or None
        return MAX_BLOCK_MS

    def _report_landed(self) -> None:
        """Report and hand over what the device landed outside a step's execute."""
        self.apply(self.update_from_output(None, self.device.take_landed()))

    def _land(self) -> None:
        """Land the batch on the device now, and report it."""
        try:
            self.device.land()
        finally:
            self._report_landed()

    # --- running a batch ---------------------------------------------------------

    def _run_batch(self, entries: list[Entry], decision: BatchDecision) -> None:
        if len(entries) == 1:
            self._run_group(entries, decision, ahead=self.device.ahead)
            return
        # A job started before and never finished may be what killed a worker: the
        # claim leaves such jobs out, and each runs alone, so it cannot take its batch
        # mates down (and use up their attempts) with it.
        claimed, written, started = self.recording.claim(entries, hold_started=True)
        if not started:
            self._run_group(entries, decision, ahead=self.device.ahead, claim=(claimed, written))
            return
        self._land()  # a suspect runs with nothing else on the device
        held = set(started)
        fresh = [e for e in entries if e.message.job_id not in held]
        groups = ([fresh] if fresh else []) + [[e] for e in entries if e.message.job_id in held]
        for number, group in enumerate(groups):
            if number and self.drain.stop.is_set():
                # Stopping: what has not run stays unacknowledged, for the next worker.
                return
            # A suspect may kill the process: what ran before it is recorded first.
            self._report_landed()
            self.recording.wait()
            self.consumer.touch([e for g in groups[number:] for e in g])
            # The fresh group was claimed above; each suspect is claimed as it runs.
            claim = (claimed, written) if group is fresh else None
            self._run_group(group, decision, claim=claim)

    def _run_group(
        self,
        entries: list[Entry],
        decision: BatchDecision,
        ahead: bool = False,
        claim: tuple[list[Claimed], list[str]] | None = None,
    ) -> None:
        """Run ``entries`` as one batch: claimed here, or already (``claim``: the jobs
        claimed and the ids settled instead)."""
        batch_id = str(uuid.uuid4())
        by_job = {e.message.job_id: e for e in entries}
        if claim is None:
            claimed, written, _ = self.recording.claim(entries)
        else:
            claimed, written = claim
        costs = [by_job[job.job_id].message.cost for job in claimed]
        started = time.perf_counter()
        flight = InFlight(batch_id, entries, claimed, costs, written, decision, started, ahead)
        if not claimed:
            # Nothing to run (cancelled, finished, late): its entries are acknowledged.
            self._land()
            self.apply([Landed(flight, Computed([], 0.0, 0.0, 1.0, None), self.state.window_s)])
            return
        jobs = [by_job[job.job_id].message for job in claimed]
        self.observers.batch_started(
            BatchStarted(batch_id, self.model, jobs, costs, decision.predicted_s, self.clock())
        )
        self.device.launch(flight)
        if ahead:
            # From the read before the decision to the batch ready to launch: what the hold
            # leaves room for. A slower one counts at once, and is forgotten a tenth a batch.
            took = flight.prepared - self._deciding
            self._prepare_s = took if self._prepare_s is None else max(took, 0.9 * self._prepare_s)
        if not ahead:
            self.device.land()  # prepared, launched and collected one after the other

    # --- recording -----------------------------------------------------------------

    def _finish(self, flight: InFlight, computed: Computed, window_s: float | None) -> None:
        """Record the outcomes, acknowledge, and tell the observers."""
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
                for job, result in zip(flight.claimed, results, strict=True)
            ]
            written = flight.written + self.recording.record(
                outcomes,
                utc_at(self.clock()),
                flight.batch_id,
                len(flight.claimed) or None,
                flight.entries,
            )
            self.recording.acknowledge(flight.entries, written, flight.batch_id)
        except BaseException as exc:
            if flight.claimed:
                flight.report_failed(self.observers, exc)
            raise
        if not flight.claimed:
            return
        by_job = {e.message.job_id: e.message for e in flight.entries}
        self.observers.batch_finished(
            BatchFinished(
                batch_id=flight.batch_id,
                model=self.model,
                jobs=[by_job[job.job_id] for job in flight.claimed],
                lanes=[e.message.lane for e in flight.entries],
                costs=flight.costs,
                trigger=flight.decision.trigger,
                predicted_s=flight.decision.predicted_s,
                batch_s=computed.batch_s,
                efficiency=computed.efficiency,
                window_s=window_s,
                peak_memory_bytes=computed.peak_memory_bytes,
                failed=failed,
                runtime_s=time.perf_counter() - flight.started,
            )
        )

    def _settle_recording(self) -> None:
        """Land the batch on the device and wait for the one being recorded.

        A failure leaves the batch's entries unacknowledged: its jobs run again.
        A lost device is raised once what was computed before it is recorded.
        """
        lost = None
        for settle in (self._land, self.recording.wait):
            try:
                settle()
            except DeviceLost as exc:
                lost = exc
            except OUTAGES as exc:
                log.warning(
                    "a batch's entries were not acknowledged; read again, its jobs are found "
                    "finished"
                    if acknowledge_failed(exc)
                    else "a batch's results were not recorded; its jobs run again",
                    extra={"model": self.model, "error_type": type(exc).__name__},
                )
            except Exception:
                log.exception(
                    "recording a batch failed; its jobs run again", extra={"model": self.model}
                )
        if lost is not None:
            raise lost

    # --- versions --------------------------------------------------------------

    def _follow_version(self) -> None:
        """Switch to a version the manager has loaded; settle jobs pinned to one not served."""
        if self.versions is not None:
            loaded = self.versions.poll()
            if loaded is not None:
                self._switch(loaded)
            else:
                self._restart_in_turn(self.versions)  # the batch on the device is recorded first
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
        self.device.runtime = loaded.runtime
        self._prepare_s = None  # the new runtime's preparation is measured afresh
        self.recorder.model_version = loaded.version
        if loaded.prepared is not None:
            self.batcher.learn_from(loaded.prepared)
        old = self.versions.switched(loaded)
        trial, self.probation = self.probation, None
        if trial is not None:
            # Another version before this one's trial ended: the one it ran is dropped, the
            # one proven before stays the one to go back to, and the held jobs run on this.
            self.versions.unloaded(old)
            old = trial.previous
            self._run_again([flight for flight, _ in trial.ended()])
        if self.config.rollback_after_failed_batches > 0:
            self.probation = Probation(old, self.config.rollback_after_failed_batches)
        else:
            # Its batches are all landed: nothing holds the old runtime once this returns.
            self.versions.unloaded(old)

    def _judge_version(self) -> None:
        """Roll back a version whose trial failed; keep the batches it holds ours meanwhile."""
        trial = self.probation
        if trial is None or not trial.held:
            return
        if not trial.failed:
            self.consumer.touch(trial.held_entries())
            return
        self._land()  # what the device holds is judged too
        if self.probation is not trial or self.versions is None:
            return  # it computed a job meanwhile: kept
        self.probation = None
        bad = self.versions.serving.version
        self.device.runtime = trial.previous.runtime
        self.recorder.model_version = trial.previous.version
        if trial.previous.prepared is not None:
            self.batcher.learn_from(trial.previous.prepared)
        self.versions.rolled_back(trial.previous, trial.reason(bad))
        self._run_again([flight for flight, _ in trial.ended()])

    def _run_again(self, flights: list[InFlight]) -> None:
        """Run held batches' jobs on the version now served (claimed again: an attempt each)."""
        for flight in flights:
            self._run_group(flight.entries, flight.decision)

    def _settle_unserved_pins(self) -> None:
        """Fail jobs pinned to a version this worker neither serves nor is going to serve."""
        now = time.monotonic()
        if now - self._pins_checked < PIN_CHECK_S:
            return  # a pass over everything pending: not every step
        self._pins_checked = now
        pending = self.batcher.pending()
        if not any(self._unserved_pin(e) for e in pending.values()):
            return
        if self.versions is not None:
            # Read the activation afresh first: the API may have seen it before this worker.
            loaded = self.versions.poll(now=True)
            if loaded is not None:
                self._switch(loaded)
        entries = self.batcher.remove(
            [key for key, e in self.batcher.pending().items() if self._unserved_pin(e)]
        )
        if not entries:
            return
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
        written = self.recording.record(outcomes, utc_at(self.clock()), None, None, entries)
        self.recording.acknowledge(entries, written)

    def _unserved_pin(self, entry: Entry) -> bool:
        """A job pinned to a version other than the one served, and not the one being loaded."""
        pin = entry.message.version
        if pin is None or pin == self.version:
            return False
        manager = self.versions
        # A job pinned to the version being loaded waits for it, unless its load failed.
        return manager is None or pin != manager.wanted or manager.failed(pin)

    # --- stopping --------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop after the current batch (a signal handler calls this)."""
        self.ready.clear()  # draining: /readyz says so at once
        self.drain.request()


__all__ = ["BatchLoop", "LoopConfig", "entry_key"]
