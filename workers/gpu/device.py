"""The device pipeline: a claimed batch prepared, launched, and collected.

On a device that computes asynchronously (CUDA; the sim model), batch N + 1
is prepared (tokenised, decoded, staged) and launched while batch N
computes: :meth:`DevicePipeline.launch` lands the batch before it once the
new one is prepared. A batch that raises while it is prepared, launched or
computed is run again input by input (:func:`~workers.gpu.execute.run_isolating`),
so only the inputs at fault fail. What the pipeline lands waits in its
output (:meth:`DevicePipeline.take_landed`) for the loop, the one place that
reports to the scheduler: the pipeline never calls back into the loop, and
what a batch taught (an out-of-memory) travels in its :class:`Computed`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.base import Launched, Runtime
from scheduler import BatchDecision
from scheduler.policy import efficiency
from workers.gpu.consumer import Entry
from workers.gpu.events import BatchObserver
from workers.gpu.execute import ItemResult, check_outputs, run_isolating
from workers.gpu.recorder import Claimed


@dataclass
class InFlight:
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
    prepared: float = 0.0  # perf_counter when it was prepared, ready to launch

    def done(self) -> bool:
        """Whether the device is done with it, without waiting."""
        return self.launched is None or self.failed is not None or self.launched.done()

    def wait(self) -> None:
        """Until the device is done with it; what the device raised is kept for landing."""
        if self.launched is not None and self.failed is None:
            try:
                self.launched.wait()
            except Exception as exc:
                self.failed = exc

    def report_failed(self, observer: BatchObserver, exc: BaseException) -> None:
        """Tell ``observer`` it broke off before it was recorded (its jobs run again)."""
        observer.batch_failed(
            self.batch_id,
            time.perf_counter() - self.started,
            len(self.claimed),
            f"{type(exc).__name__} while running or recording it (jobs not acknowledged run again)",
        )


@dataclass(frozen=True)
class Computed:
    """A batch run and not yet recorded.

    ``batch_s``: its latency as the scheduler plans it (what it kept the next
    batch waiting); ``device_s``: the device's busy time;
    ``out_of_memory``: the costs of each part of it that ran out of memory
    (it was split), for the scheduler to lower its memory ceiling.
    """

    results: list[ItemResult]
    batch_s: float
    device_s: float
    efficiency: float
    peak_memory_bytes: float | None
    out_of_memory: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def ooms(self) -> int:
        """How many times it ran out of memory."""
        return len(self.out_of_memory)

    @property
    def split(self) -> bool:
        """Split around an out-of-memory or a failing input: not what its work costs."""
        return self.ooms > 0 or any(not r.ok for r in self.results)


class DevicePipeline:
    """Runs claimed batches on ``runtime``; with ``launch_ahead``, one computes while the next
    is prepared."""

    def __init__(
        self,
        model: str,
        runtime: Runtime,
        observer: BatchObserver,
        *,
        launch_ahead: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model = model
        self.observer = observer
        self.launch_ahead = launch_ahead
        self.clock = clock
        self.runtime = runtime
        self.in_flight: InFlight | None = None
        # Batches landed and not yet taken by the loop, in the order they landed.
        self._landed: list[tuple[InFlight, Computed]] = []

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    @runtime.setter
    def runtime(self, runtime: Runtime) -> None:
        """Batches launched from now on run on ``runtime`` (land the one in flight first)."""
        self._runtime = runtime
        self.ahead = self.launch_ahead and runtime.asynchronous

    def launch(self, flight: InFlight) -> None:
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
        else:
            self.observer.stage_timed(
                "prepare", time.perf_counter() - flight.began, flight.batch_id
            )
        flight.prepared = time.perf_counter()
        previous, self.in_flight = self.in_flight, None
        if previous is not None:
            previous.wait()
            if previous.failed is not None:
                # It runs again input by input (or halved) with nothing else on
                # the device, so that what it teaches (a lower memory ceiling)
                # and the peaks measured belong to it alone.
                self._land_batch(previous)
                previous = None
        # The device starts on it while launch queues its work: its end counts from here.
        launching = self.clock()
        if prepared is not None:
            try:
                flight.launched = self.runtime.launch(prepared)
            except Exception as exc:
                flight.failed = exc
        flight.ends_s = launching + flight.decision.predicted_s
        self.in_flight = flight
        if previous is not None:
            self._land_batch(previous)  # while this one computes
        if flight.failed is not None:
            self.land()  # the same, at once: the device is idle

    def land(self) -> None:
        """Wait for the batch on the device, if there is one, and put it in the output."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            flight.wait()
            self._land_batch(flight)

    def take_landed(self) -> list[tuple[InFlight, Computed]]:
        """The batches landed since the last call, oldest first."""
        landed, self._landed = self._landed, []
        return landed

    def _land_batch(self, flight: InFlight) -> None:
        try:
            computed = self._collect(flight)
        except BaseException as exc:
            flight.report_failed(self.observer, exc)
            raise
        self._landed.append((flight, computed))

    def _collect(self, flight: InFlight) -> Computed:
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
                return Computed(
                    results,
                    batch_s,
                    launched.device_s,
                    efficiency(flight.costs),
                    launched.peak_memory_bytes,
                )
        return self.compute(flight, failed=failed)

    def compute(self, flight: InFlight, failed: Exception | None = None) -> Computed:
        """Run the claimed jobs now, one call at a time, isolating the inputs at fault.

        ``failed``: what the whole batch raised when it was launched ahead.
        """
        costs = flight.costs
        ooms: list[tuple[int, ...]] = []

        def out_of_memory(start: int, end: int) -> None:
            ooms.append(tuple(costs[start:end]))

        began = time.perf_counter()
        results = run_isolating(
            self.runtime.run,
            [c.input for c in flight.claimed],
            on_oom=out_of_memory,
            failed=failed,
        )
        batch_s = time.perf_counter() - began
        return Computed(
            results,
            batch_s,
            batch_s,
            efficiency(costs),
            self.runtime.peak_memory_bytes,
            tuple(ooms),
        )
