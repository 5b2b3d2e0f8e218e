"""A GPU worker's batch loop on a thread of this process, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from core.config.settings import Settings
from harness.threads import OnAThread
from workers.gpu.loop import BatchLoop
from workers.gpu.main import build_loop


@contextmanager
def running_worker(settings: Settings, model: str, name: str) -> Iterator[BatchLoop]:
    """A worker's batch loop on a thread of this process, stopped afterwards."""
    loop = build_loop(settings, model, name=name)
    with OnAThread(loop.run):
        yield loop
