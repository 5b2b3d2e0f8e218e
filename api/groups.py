"""A stage that gathers the requests arriving together and does their work as one.

Ferry batches its own work the way its workers batch the model's: the
submissions of one moment share a transaction (``api.jobs.submissions``), the
reads of one moment share a query (``api.jobs.reads``). A group is whatever
waited while the previous group was being worked on, plus what arrives
within ``wait_s`` of its first request, at most ``max_items``; ``workers``
groups are worked on at a time, each in a thread of the stage's own (one
hop per group, not per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from api.errors import ApiError

log = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


class GroupStage(Generic[In, Out]):
    """``await stage.submit(item)``: the item's result, or its exception raised.

    ``work`` takes a group and returns, in the group's order, each item's
    result or the exception (an ApiError) its request fails with.
    """

    def __init__(
        self,
        name: str,
        work: Callable[[Sequence[In]], Sequence[Out | Exception]],
        *,
        max_items: int,
        wait_s: float,
        workers: int = 1,
    ) -> None:
        self.name = name
        self._work = work
        self.max_items = max_items
        self.wait_s = wait_s
        self.workers = workers
        self._queue: asyncio.Queue[tuple[In, asyncio.Future[Out]]] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name=f"{self.name}-{n}") for n in range(self.workers)
        ]

    async def stop(self) -> None:
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while not self._queue.empty():
            _, future = self._queue.get_nowait()
            if not future.done():
                future.set_exception(_stopping())
        # A group being worked on finishes in its thread (a commit is not cut
        # short); the event loop does not wait for it.
        self._executor.shutdown(wait=False)

    async def submit(self, item: In) -> Out:
        if self._stopped:
            raise _stopping()
        future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            group = [await self._queue.get()]
            try:
                if self.wait_s > 0 and self._queue.qsize() < self.max_items - 1:
                    await asyncio.sleep(self.wait_s)
                while len(group) < self.max_items and not self._queue.empty():
                    group.append(self._queue.get_nowait())
                items = [item for item, _ in group]
                results: Sequence[Out | Exception]
                try:
                    results = await loop.run_in_executor(self._executor, self._work, items)
                    if len(results) != len(group):
                        raise RuntimeError(f"{len(results)} results for a group of {len(group)}")
                except Exception as exc:  # a bug, not an outage: each request gets a 500
                    log.exception("group failed", extra={"stage": self.name})
                    results = [exc] * len(group)
                for (_, future), result in zip(group, results, strict=True):
                    if future.done():
                        continue  # the client went away (a submission is written all the same)
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
            except asyncio.CancelledError:
                # Stopping: the group in hand is answered (its work, if begun,
                # finishes in its thread, but nobody waits for it here).
                for _, future in group:
                    if not future.done():
                        future.set_exception(_stopping())
                raise


def _stopping() -> ApiError:
    return ApiError(503, "unavailable", "the API is stopping; retry", {"Retry-After": "1"})
