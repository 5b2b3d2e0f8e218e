"""A worker's spans (tracing on): an observer of its batches, like its metrics.

A batch serves many traces, so it is a trace of its own (``ferry.batch``,
with a span per stage: ``ferry.prepare``, ``ferry.record``,
``ferry.acknowledge``), linked to the trace of every job in it. Each job's
own trace, continued from the traceparent in its stream entry, gets
``ferry.queue_wait`` (accepted to its batch starting) and ``ferry.run`` (its
batch starting to its outcome acknowledged, linked to the batch), with
``ferry.result_write`` inside it. Spans are made after the fact, with the
times the loop measured, so tracing adds no step to a batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, StatusCode

from core.ops import tracing
from core.streams.protocol import JobMessage
from workers.gpu.events import BatchFinished, BatchObserver, BatchStarted, JobDone


@dataclass
class _Batch:
    span: Span
    runs: dict[str, Span] = field(default_factory=dict)  # job id -> its ferry.run


class Tracing(BatchObserver):
    """Hooks run on the loop's thread and the recording thread: state is locked."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._batches: dict[str, _Batch] = {}
        self._runs: dict[str, Span] = {}

    def batch_started(self, batch: BatchStarted) -> None:
        tracer = tracing.tracer()
        start_ns = int(batch.at_s * 1e9)
        links = [
            Link(context)
            for job in batch.jobs
            if (context := tracing.span_context_of(job.trace_context)) is not None
        ]
        span = tracer.start_span(
            "ferry.batch",
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a trace of its own
            kind=SpanKind.CONSUMER,
            start_time=start_ns,
            links=links,
            attributes={
                "ferry.model": self.model,
                "ferry.batch_id": batch.batch_id,
                "ferry.batch_size": len(batch.jobs),
                "ferry.batch_cost": sum(batch.costs),
            },
        )
        opened = _Batch(span)
        for job in batch.jobs:
            parent = tracing.context_of(job.trace_context)
            if parent is None:
                continue
            attributes = {
                "ferry.model": self.model,
                "ferry.job_id": job.job_id,
                "ferry.lane": job.lane,
                "ferry.batch_id": batch.batch_id,
            }
            wait = tracer.start_span(
                "ferry.queue_wait",
                context=parent,
                start_time=min(job.enqueued_at_ms * 1_000_000, start_ns),
                attributes=attributes,
            )
            wait.end(end_time=start_ns)
            opened.runs[job.job_id] = tracer.start_span(
                "ferry.run",
                context=parent,
                kind=SpanKind.CONSUMER,
                start_time=start_ns,
                links=[Link(span.get_span_context())],
                attributes=attributes,
            )
        with self._lock:
            self._batches[batch.batch_id] = opened
            self._runs.update(opened.runs)

    def stage_timed(self, stage: str, seconds: float, batch_id: str | None) -> None:
        with self._lock:
            opened = self._batches.get(batch_id) if batch_id else None
        if opened is None:
            return
        end_ns = time.time_ns()
        start_ns = end_ns - int(seconds * 1e9)
        tracer = tracing.tracer()
        child = tracer.start_span(
            f"ferry.{stage}",
            context=trace.set_span_in_context(opened.span),
            start_time=start_ns,
        )
        child.end(end_time=end_ns)
        if stage == "record":
            for run in opened.runs.values():
                write = tracer.start_span(
                    "ferry.result_write",
                    context=trace.set_span_in_context(run),
                    start_time=start_ns,
                )
                write.end(end_time=end_ns)

    def batch_finished(self, batch: BatchFinished) -> None:
        with self._lock:
            opened = self._batches.pop(batch.batch_id, None)
            # Runs not ended by now had no outcome written (the conditional write
            # refused a late result): they end here, saying so.
            unwritten = [
                run
                for job_id, run in (opened.runs.items() if opened else ())
                if self._runs.get(job_id) is run and self._runs.pop(job_id)
            ]
        for run in unwritten:
            run.set_attribute("ferry.written", False)
            run.end()
        if opened is None:
            return
        opened.span.set_attribute("ferry.efficiency", round(batch.efficiency, 4))
        opened.span.set_attribute("ferry.failed", batch.failed)
        if batch.trigger:
            opened.span.set_attribute("ferry.trigger", batch.trigger)
        opened.span.end()

    def batch_failed(self, batch_id: str, runtime_s: float, size: int, error: str) -> None:
        with self._lock:
            opened = self._batches.pop(batch_id, None)
            for job_id in opened.runs if opened else ():
                self._runs.pop(job_id, None)
        if opened is None:
            return
        for span in (opened.span, *opened.runs.values()):
            span.set_status(StatusCode.ERROR, error)
            span.end()

    def jobs_finished(self, done: Sequence[JobDone], batch_id: str | None, at_s: float) -> None:
        with self._lock:
            runs = [(finished, self._runs.pop(finished.job.job_id, None)) for finished in done]
        for finished, run in runs:
            if run is None:
                continue
            run.set_attribute("ferry.status", finished.status)
            if finished.status != "succeeded":
                run.set_status(StatusCode.ERROR, finished.status)
            run.end()

    def jobs_dead_lettered(self, jobs: Sequence[JobMessage]) -> None:
        with self._lock:
            runs = [self._runs.pop(job.job_id, None) for job in jobs]
        for run in runs:
            if run is not None:
                run.set_status(StatusCode.ERROR, "dead-lettered")
                run.end()
