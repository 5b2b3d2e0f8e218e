"""The one loop of every worker: read, schedule, execute, update from the output, apply.

A worker serves one model, an encoder (:class:`~workers.gpu.loop.BatchLoop`)
or a generation model (:class:`~workers.gpu.generation_loop.GenerationLoop`),
and both turn the same loop, in the shape of vLLM's engine core. Each
:meth:`WorkerLoop.step` goes one way:

1. ``upkeep``: keep held entries ours, take over a dead worker's, follow
   cancellations and versions;
2. ``read``: take what fits from the model's streams, waiting only when
   there is nothing to run;
3. ``schedule``: the scheduler's decision for this step (a pure object);
4. ``start``: the decision's writes before anything runs: jobs that will
   never run are settled, and the jobs that start are claimed (an encoder
   claims each group of its batch as the group is launched, so that a job
   isolated after a crash is charged an attempt only when it runs);
5. ``execute``: the runtime runs the step: for an encoder, a batch that
   prefills and finishes everything it holds (landing the one launched
   before it); for a generation model, one token for every running sequence;
6. ``update_from_output``: what the step computed is reported to the
   scheduler, here and nowhere else, and becomes the step's events;
7. ``apply``: the events are acted on: tokens streamed, outcomes recorded,
   entries acknowledged, observers told.

What differs between the kinds is what each of those does; how a worker
starts, rides out an outage of Redis or the database, drains and stops is
this class's, once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

import redis
from sqlalchemy.exc import SQLAlchemyError

from core.streams.target import REDIS_ERRORS, RedisTarget
from workers.gpu.consumer import StreamConsumer
from workers.gpu.learned import Publisher
from workers.gpu.recording import RETRY_MAX_S, RETRY_MIN_S, retry_extra
from workers.gpu.versions import VersionManager

log = logging.getLogger(__name__)

# Redis or the database failing: the loop waits and goes on; it never stops for them.
OUTAGES: tuple[type[Exception], ...] = (*REDIS_ERRORS, SQLAlchemyError)

# The longest a read waits for something to arrive when there is nothing to run.
MAX_BLOCK_MS = 1000
# The longest the worker waits for any Redis reply (its blocking reads wait at
# most MAX_BLOCK_MS): later, the connection is taken for gone, so a host cut
# off without a reset (a half-open connection) is an outage the loop rides out,
# not a read that hangs until TCP gives up.
REDIS_REPLY_TIMEOUT_S = 10.0
REDIS_CONNECT_TIMEOUT_S = 5.0


def worker_redis(
    target: RedisTarget, reply_timeout_s: float = REDIS_REPLY_TIMEOUT_S
) -> redis.Redis:
    """The worker's Redis client: replies bounded by ``reply_timeout_s``."""
    return target.client(
        decode_responses=True,
        socket_timeout=reply_timeout_s,
        socket_connect_timeout=min(REDIS_CONNECT_TIMEOUT_S, reply_timeout_s),
    )


PlanT = TypeVar("PlanT")
OutputT = TypeVar("OutputT")
EventsT = TypeVar("EventsT")


class WorkerLoop(ABC, Generic[PlanT, OutputT, EventsT]):
    """A worker's loop; a subclass says what each part of a step does for its kind."""

    consumer: StreamConsumer
    publisher: Publisher

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        # Set once the worker reads its streams; cleared when it cannot, and when it
        # stops (the /readyz of its port).
        self.ready = threading.Event()
        # The loop stopped so that its process restarts with another version.
        self.restart_requested = False
        # How long the next read may wait for entries (None: not at all).
        self.wait_ms: int | None = MAX_BLOCK_MS
        self.steps = 0  # steps that ran something on the device
        # The event that stops run(), set by the process (workers.gpu.main.run_to_exit).
        self.stop_event: threading.Event | None = None

    @property
    def model(self) -> str:
        return self.consumer.model

    # --- a step ----------------------------------------------------------------

    def step(self) -> None:
        """One turn, one way: read, schedule, start, execute, update, apply."""
        self.upkeep()
        self.read(self.wait_ms)
        plan = self.schedule(self.clock())
        self.start(plan)
        output = self.execute(plan)
        events = self.update_from_output(plan, output)
        if self.ran(plan):
            self.steps += 1
        self.apply(events)
        self.wait_ms = self.next_wait_ms(plan)

    @abstractmethod
    def upkeep(self) -> None:
        """Keep what is held ours, take over what a dead worker left, follow cancels."""

    @abstractmethod
    def read(self, block_ms: int | None) -> None:
        """Take what fits from the streams, waiting up to ``block_ms`` for it."""

    @abstractmethod
    def schedule(self, now: float) -> PlanT:
        """The scheduler's decision for this step."""

    @abstractmethod
    def start(self, plan: PlanT) -> None:
        """Before the step runs: settle what will never run, claim what starts."""

    @abstractmethod
    def execute(self, plan: PlanT) -> OutputT:
        """Run the step on the device."""

    @abstractmethod
    def update_from_output(self, plan: PlanT, output: OutputT) -> EventsT:
        """Report what the step computed to the scheduler; what the step did."""

    @abstractmethod
    def apply(self, events: EventsT) -> None:
        """Stream, record, acknowledge and tell the observers what the step did."""

    @abstractmethod
    def ran(self, plan: PlanT) -> bool:
        """Whether the step ran something on the device."""

    @abstractmethod
    def next_wait_ms(self, plan: PlanT) -> int | None:
        """How long the next read may wait: None when more is ready to run."""

    # --- what else differs between the kinds ---------------------------------------

    def join(self) -> None:
        """Before the first step: the consumer groups (Redis errors are retried)."""
        self.consumer.ensure_groups()

    def begin(self) -> None:
        """Once joined, before the first step (hot reload's poller starts here)."""

    @abstractmethod
    def forget(self) -> None:
        """Redis or the database failed: drop the local copies of what is held.

        Whatever was read but not recorded is still pending in Redis and is
        read again once they are back.
        """

    def finish_running(self) -> None:
        """The stop was asked for: what runs may finish now, for a bounded time."""

    @abstractmethod
    def close(self) -> None:
        """The loop has stopped: settle what is in flight and release what it holds."""

    @abstractmethod
    def request_stop(self) -> None:
        """Stop after what runs now (a signal handler calls this)."""

    def _restart_in_turn(self, versions: VersionManager) -> None:
        """Stop, once it is this worker's turn, so that its process restarts to load the
        version that did not fit beside the one serving (what runs finishes first)."""
        if (
            versions.restart_for is not None
            and not self.restart_requested
            and versions.take_restart_turn()
        ):
            log.info(
                "restarting to load another version alone",
                extra={"model": self.model, "version": versions.restart_for},
            )
            self.restart_requested = True
            self.request_stop()

    # --- running ---------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Turn the loop until ``stop`` is set; stay up through outages."""
        self._retrying(stop, self.join)
        self.begin()
        self.ready.set()
        log.info("worker ready", extra={"model": self.model, "consumer": self.consumer.consumer})
        backoff_s = RETRY_MIN_S
        try:
            while not stop.is_set():
                try:
                    self.step()
                    backoff_s = RETRY_MIN_S
                    if not stop.is_set():
                        self.ready.set()
                except OUTAGES as exc:
                    self.ready.clear()  # it can run nothing until Redis and the database are back
                    log.warning(
                        "dependency error; retrying", extra=retry_extra(self.model, exc, backoff_s)
                    )
                    self.forget()
                    stop.wait(backoff_s)
                    if isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
                        # Redis lost its data (restarted empty, failed over): make the
                        # groups again; the reconciler re-enqueues what was lost.
                        with contextlib.suppress(*REDIS_ERRORS):
                            self.consumer.ensure_groups()
                    backoff_s = min(backoff_s * 2, RETRY_MAX_S)
                    self.wait_ms = MAX_BLOCK_MS
            self.finish_running()
        finally:
            try:
                self.close()
            finally:
                self.ready.clear()
                # Entries read but not run stay unacknowledged; this consumer name
                # gets them back at its next start.
                self.publisher.leave()
                log.info(
                    "worker stopped", extra={"model": self.model, "left_pending": self.held_count}
                )

    @property
    @abstractmethod
    def held_count(self) -> int:
        """How many entries the worker holds (read and not acknowledged)."""

    def _retrying(self, stop: threading.Event, action: Callable[[], None]) -> None:
        backoff_s = RETRY_MIN_S
        while not stop.is_set():
            try:
                action()
                return
            except REDIS_ERRORS as exc:
                log.warning("redis unavailable; retrying", extra={"error_type": type(exc).__name__})
                stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, RETRY_MAX_S)


__all__ = ["MAX_BLOCK_MS", "OUTAGES", "WorkerLoop", "worker_redis"]
