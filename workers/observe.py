"""The GPU worker's metrics: a hook beside the batch loop, never inside its decisions."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from core.metrics import (
    BATCH_COST,
    BATCH_EFFICIENCY,
    BATCH_LATENCY,
    BATCH_PREDICTED,
    BATCH_SIZE,
    BATCH_WINDOW,
    COMPUTE_SECONDS,
    ENTRIES_RECLAIMED,
    JOB_LATENCY,
    JOB_QUEUE_WAIT,
    JOBS_DEAD_LETTERED,
    JOBS_FINISHED,
    MEMORY,
)
from core.streams import JobMessage

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class LoopMetrics:
    def __init__(self, model: str, device: str = "cpu") -> None:
        self.model = model
        self.device = device

    def started(self, messages: Iterable[JobMessage], now_s: float) -> None:
        for message in messages:
            JOB_QUEUE_WAIT.labels(self.model, message.lane).observe(
                max(now_s - message.enqueued_at_ms / 1000.0, 0.0)
            )

    def finished(self, done: Iterable[tuple[JobMessage, str]], now_s: float) -> None:
        for message, status in done:
            JOBS_FINISHED.labels(self.model, message.lane, status).inc()
            JOB_LATENCY.labels(self.model, message.lane).observe(
                max(now_s - message.enqueued_at_ms / 1000.0, 0.0)
            )

    def batch(
        self,
        costs: Sequence[int],
        latency_s: float,
        predicted_s: float,
        efficiency: float,
        window_s: float | None,
        peak_memory_bytes: float | None,
    ) -> None:
        if costs:
            BATCH_SIZE.labels(self.model).observe(len(costs))
            BATCH_COST.labels(self.model).observe(sum(costs))
            BATCH_EFFICIENCY.labels(self.model).observe(efficiency)
            BATCH_LATENCY.labels(self.model).observe(latency_s)
            BATCH_PREDICTED.labels(self.model).observe(predicted_s)
        if window_s is not None:
            BATCH_WINDOW.labels(self.model).set(window_s)
        # On a GPU the runtime measures its batch's peak; on the CPU, the process's.
        MEMORY.labels(self.model, "peak").set(
            peak_memory_bytes if peak_memory_bytes is not None else _peak_resident_bytes()
        )
        MEMORY.labels(self.model, "in_use").set(
            _cuda_allocated_bytes(self.device)
            if self.device.startswith("cuda")
            else _resident_bytes()
        )

    def computed(self, seconds: float) -> None:
        COMPUTE_SECONDS.labels(self.model).inc(seconds)

    def reclaimed(self, count: int) -> None:
        if count:
            ENTRIES_RECLAIMED.labels(self.model).inc(count)

    def dead_lettered(self, messages: Iterable[JobMessage]) -> None:
        for message in messages:
            JOBS_DEAD_LETTERED.labels(self.model, message.lane).inc()


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
