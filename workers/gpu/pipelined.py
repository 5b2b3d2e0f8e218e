"""Work a worker hands over to a thread of its own, one task at a time, while its loop goes on."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Pipelined(Generic[T]):
    """Runs tasks on a thread named ``name``, or, not ``pipelined``, at once in the caller's.

    One task at most is meant to be in flight: the caller waits for the last
    before it hands over the next, and what the last raised is raised by that
    :meth:`wait`, in the caller's thread.
    """

    def __init__(self, name: str, pipelined: bool) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name) if pipelined else None
        self.in_flight: Future[T] | None = None

    def submit(self, task: Callable[..., T], *args: Any) -> None:
        """Run ``task(*args)``: on the thread, or now (what it raises is raised here)."""
        if self._thread is None:
            task(*args)
        else:
            self.in_flight = self._thread.submit(task, *args)

    def wait(self) -> None:
        """Until the task in flight is done; re-raises what it raised."""
        if self.in_flight is not None:
            in_flight, self.in_flight = self.in_flight, None
            in_flight.result()

    def done(self) -> bool:
        """Whether a task was in flight and has ended (well or not: ``wait`` says which)."""
        return self.in_flight is not None and self.in_flight.done()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
