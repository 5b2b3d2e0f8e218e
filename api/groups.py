"""A stage that gathers the requests arriving together and does their work as one.

Ferry batches its own work the way its workers batch the model's: the
submissions of one moment share a transaction (``api.jobs.submissions``), the
reads of one moment share a query (``api.jobs.reads``). A group is whatever
waited while the previous group was being worked on, plus, for at most
``wait_s`` after its first item, what requests already being read bring
(:meth:`GroupStage.coming`), at most ``max_items``; ``workers`` groups are
worked on at a time, each in a thread of the stage's own (one hop per group,
not per request), or on the event loop itself where the work is a coroutine
(reads on PostgreSQL's asyncio connections: no hop at all); one group gathers
at a time.

A group waits only where more is coming, in the manner of PostgreSQL's
``commit_delay`` with ``commit_siblings``: requests announced to the stage and
still being read, or a pace of arrivals closer together than ``wait_s`` that
comes from callers in parallel (most arrive while others are unanswered, or
waiting has lately gathered some). A lone request, or one client's one at a
time, is worked on at once; a busy process writes what arrives together in
one group instead of one each. A group's transaction costs the database about
as much for one row as for eight, so the group's size decides what a
submission costs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import KW_ONLY, dataclass
from typing import Any, Generic, TypeVar, cast

from api.errors import ApiError

log = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass(eq=False)
class _Coming:
    """A request announced to a stage and not yet arrived (its items submitted, or its
    handling over)."""

    stage: GroupStage[Any, Any]
    open: bool = True


# The arrivals' gap is averaged with this weight for the newest; an idle second (or twice
# the stage's wait, if longer) counts as one, so that after a quiet spell a group's first
# item goes at once.
GAP_WEIGHT = 0.2
GAP_CEILING_S = 1.0
# Waiting on the arrivals' pace alone asks that at least this share of them came while
# another was unanswered, or of such waits gathered something.
SHARE = 0.5
# The announcement of the request this task handles, if any: its submit closes it.
_COMING: ContextVar[_Coming | None] = ContextVar("ferry_group_coming", default=None)


@dataclass(eq=False)
class GroupStage(Generic[In, Out]):
    """``await stage.submit(item)``: the item's result, or its exception raised.

    ``work`` takes a group and returns, in the group's order, each item's
    result or the exception (an ApiError) its request fails with; a plain function
    runs in the stage's threads, a coroutine function on the event loop.
    """

    name: str
    work: (
        Callable[[Sequence[In]], Sequence[Out | Exception]]
        | Callable[[Sequence[In]], Awaitable[Sequence[Out | Exception]]]
    )
    _: KW_ONLY
    max_items: int
    wait_s: float
    workers: int = 1

    def __post_init__(self) -> None:
        self._queue: asyncio.Queue[tuple[In, asyncio.Future[Out]]] = asyncio.Queue()
        self._in_loop = inspect.iscoroutinefunction(self.work)
        self._executor = (
            None
            if self._in_loop
            else ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name)
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        self._coming = 0  # requests announced and not yet arrived
        self._news = asyncio.Event()  # an item queued or an announcement closed
        self._gathering = asyncio.Lock()
        # The recent gap between arrivals (an exponentially weighted mean, seconds), so
        # that a group waits only where another arrival is likely within ``wait_s``.
        self._gap_ceiling = max(GAP_CEILING_S, 2 * self.wait_s)
        self._gap = self._gap_ceiling
        self._last_arrival = 0.0
        # Items submitted and not yet answered, and the recent share of arrivals that came
        # while one was (weighted as the gap): a client that waits for each answer before
        # its next submission is never company for itself, however fast it goes.
        self._unanswered = 0
        self._overlap = 0.0
        # The recent share of waits on the pace that gathered something: a caller whose
        # arrivals are close but never together (one client that waits for each answer,
        # served faster than it asks) stops being waited for after a wait or two.
        self._fruitful = SHARE

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
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    @contextlib.contextmanager
    def coming(self) -> Iterator[None]:
        """Around the handling of a request that will submit to this stage, from before its
        body is read: a group gathering meanwhile waits for its items (at most ``wait_s``).
        The announcement ends at the request's first :meth:`submit` or :meth:`submit_all`,
        or when the block ends (a request refused before it submits)."""
        coming = _Coming(self)
        self._coming += 1
        token = _COMING.set(coming)
        try:
            yield
        finally:
            _COMING.reset(token)
            self._arrived(coming)

    def _arrived(self, coming: _Coming | None) -> None:
        if coming is not None and coming.stage is self and coming.open:
            coming.open = False
            self._coming -= 1
        self._news.set()

    async def submit(self, item: In) -> Out:
        # Its own future awaited: asyncio.gather over a list of one cost a read about a
        # tenth of the API's CPU.
        (future,) = self._queued([item])
        return await future

    async def submit_all(self, items: Sequence[In]) -> list[Out]:
        """Each item's result, the items queued together (so they join one group); the first
        exception raised, as :func:`asyncio.gather` would."""
        return list(await asyncio.gather(*self._queued(items)))

    async def submit_each(self, items: Sequence[In]) -> list[Out | BaseException]:
        """Each item's result, or what it raised, the items queued together."""
        return list(await asyncio.gather(*self._queued(items), return_exceptions=True))

    def _queued(self, items: Sequence[In]) -> list[asyncio.Future[Out]]:
        """Queue the items, noting their arrival and closing the request's announcement."""
        if self._stopped:
            raise _stopping()
        loop = asyncio.get_running_loop()
        now = loop.time()
        gap = min(now - self._last_arrival, self._gap_ceiling)
        self._gap += GAP_WEIGHT * (gap - self._gap)
        self._last_arrival = now
        self._overlap += GAP_WEIGHT * ((1.0 if self._unanswered else 0.0) - self._overlap)
        self._unanswered += len(items)
        futures: list[asyncio.Future[Out]] = []
        for item in items:
            future: asyncio.Future[Out] = loop.create_future()
            self._queue.put_nowait((item, future))
            futures.append(future)
        self._arrived(_COMING.get())
        return futures

    def _paced(self) -> bool:
        """Whether the recent arrivals say more is coming within ``wait_s``: they came less
        than that apart, and either mostly while others were in hand or waiting for them
        has lately gathered some."""
        return self._gap < self.wait_s and (self._overlap >= SHARE or self._fruitful >= SHARE)

    async def _gather(self, group: list[tuple[In, asyncio.Future[Out]]]) -> None:
        """Fill ``group`` with the next group: its first item, then, for at most ``wait_s``,
        what arrives while more is expected: requests announced to this stage are on their
        way, or the pace of arrivals says more will come (:meth:`_paced`)."""
        loop = asyncio.get_running_loop()
        async with self._gathering:
            group.append(await self._queue.get())
            until = loop.time() + self.wait_s
            queued = self._queue.qsize()
            paced = False
            while self._queue.qsize() < self.max_items - 1:
                if self._coming == 0:
                    if not self._paced():
                        break
                    paced = True
                left = until - loop.time()
                if left <= 0:
                    break
                self._news.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._news.wait(), left)
            if paced:
                gathered = 1.0 if self._queue.qsize() > queued else 0.0
                self._fruitful += GAP_WEIGHT * (gathered - self._fruitful)
            while len(group) < self.max_items and not self._queue.empty():
                group.append(self._queue.get_nowait())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            group: list[tuple[In, asyncio.Future[Out]]] = []
            try:
                await self._gather(group)
                items = [item for item, _ in group]
                results: Sequence[Out | Exception]
                try:
                    if self._in_loop:
                        results = await cast(Awaitable[Sequence[Out | Exception]], self.work(items))
                    else:
                        results = await loop.run_in_executor(
                            self._executor,
                            cast(Callable[[Sequence[In]], Sequence[Out | Exception]], self.work),
                            items,
                        )
                    if len(results) != len(group):
                        raise RuntimeError(f"{len(results)} results for a group of {len(group)}")
                except Exception as exc:  # a bug, not an outage: each request gets a 500
                    log.exception("group failed", extra={"stage": self.name})
                    results = [exc] * len(group)
                self._unanswered -= len(group)
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
