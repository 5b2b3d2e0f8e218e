"""The GPU worker's metrics: an observer of its batches, never inside their decisions."""

from __future__ import annotations

import os
from collections.abc import Sequence

from core.ops.metrics import (
    BATCH_COST,
    BATCH_EFFICIENCY,
    BATCH_LATENCY,
    BATCH_PREDICTED,
    BATCH_SIZE,
    BATCH_STAGE,
    BATCH_WINDOW,
    COMPUTE_SECONDS,
    ENTRIES_RECLAIMED,
    JOB_LATENCY,
    JOB_QUEUE_WAIT,
    JOBS_DEAD_LETTERED,
    JOBS_FINISHED,
    MEMORY,
)
from core.streams.protocol import JobMessage
from workers.gpu.events import BatchFinished, BatchObserver, BatchStarted, JobDone

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Metrics(BatchObserver):
    """The Prometheus side of a worker's batches."""

    def __init__(self, model: str, device: str = "cpu") -> None:
        self.model = model
        self.device = device

    def batch_started(self, batch: BatchStarted) -> None:
        for job in batch.jobs:
            JOB_QUEUE_WAIT.labels(self.model, job.lane).observe(
                max(batch.at_s - job.enqueued_at_ms / 1000.0, 0.0)
            )

    def jobs_finished(self, done: Sequence[JobDone], batch_id: str | None, at_s: float) -> None:
        for finished in done:
            job = finished.job
            JOBS_FINISHED.labels(self.model, job.lane, finished.status).inc()
            JOB_LATENCY.labels(self.model, job.lane).observe(
                max(at_s - job.enqueued_at_ms / 1000.0, 0.0)
            )

    def batch_finished(self, batch: BatchFinished) -> None:
        costs = batch.costs
        if costs:
            BATCH_SIZE.labels(self.model).observe(len(costs))
            BATCH_COST.labels(self.model).observe(sum(costs))
            BATCH_EFFICIENCY.labels(self.model).observe(batch.efficiency)
            BATCH_LATENCY.labels(self.model).observe(batch.batch_s)
            BATCH_PREDICTED.labels(self.model).observe(batch.predicted_s)
        if batch.window_s is not None:
            BATCH_WINDOW.labels(self.model).set(batch.window_s)
        # On a GPU the runtime measures its batch's peak; on the CPU, the process's.
        peak = batch.peak_memory_bytes
        MEMORY.labels(self.model, "peak").set(peak if peak is not None else _peak_resident_bytes())
        MEMORY.labels(self.model, "in_use").set(
            _cuda_allocated_bytes(self.device)
            if self.device.startswith("cuda")
            else _resident_bytes()
        )

    def batch_computed(self, device_s: float) -> None:
        COMPUTE_SECONDS.labels(self.model).inc(device_s)
        BATCH_STAGE.labels(self.model, "compute").observe(device_s)

    def stage_timed(self, stage: str, seconds: float, batch_id: str | None) -> None:
        BATCH_STAGE.labels(self.model, stage).observe(seconds)

    def entries_reclaimed(self, count: int) -> None:
        if count:
            ENTRIES_RECLAIMED.labels(self.model).inc(count)

    def jobs_dead_lettered(self, jobs: Sequence[JobMessage]) -> None:
        for job in jobs:
            JOBS_DEAD_LETTERED.labels(self.model, job.lane).inc()


def _peak_resident_bytes() -> float:
    try:
        import resource
    except ImportError:  # not on this platform
        return 0.0
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux


def _cuda_allocated_bytes(device: str) -> float:
    """What the caching allocator has handed out on the worker's device."""
    import torch

    return float(torch.cuda.memory_allocated(torch.device(device)))


def _resident_bytes() -> float:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return float(int(statm.read().split()[1]) * _PAGE)
    except (OSError, ValueError, IndexError):
        return 0.0
