"""How a group stage gathers: at once when nothing else is coming, and waiting (at most its
``wait_s``) for requests announced to it or for arrivals that come closer than that."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

import pytest

from api.groups import GroupStage


class Recorder:
    """A stage's work: records each group's items, answers item * 10."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []

    def __call__(self, items: Sequence[int]) -> list[int | Exception]:
        self.groups.append(list(items))
        return [item * 10 for item in items]


@contextlib.asynccontextmanager
async def running(
    work: Recorder, wait_s: float, workers: int = 1
) -> AsyncIterator[GroupStage[int, int]]:
    stage = GroupStage("test", work, max_items=64, wait_s=wait_s, workers=workers)
    stage.start()
    try:
        yield stage
    finally:
        await stage.stop()


async def announced(stage: GroupStage[int, int], item: int, read_s: float) -> int:
    """A request announced to ``stage`` that submits ``item`` once its body is read."""
    with stage.coming():
        await asyncio.sleep(read_s)
        return await stage.submit(item)


async def timed(stage: GroupStage[int, int], item: int) -> float:
    """The seconds ``item`` took to be answered (checking the answer)."""
    began = time.monotonic()
    assert await stage.submit(item) == item * 10
    return time.monotonic() - began


def test_a_lone_item_is_worked_on_at_once_however_long_the_stage_may_wait() -> None:
    work = Recorder()

    async def run() -> float:
        async with running(work, wait_s=5.0) as stage:
            return await timed(stage, 4)

    took = asyncio.run(run())
    assert took < 1.0, took
    assert work.groups == [[4]]


def test_a_group_waits_for_a_request_announced_to_it() -> None:
    work = Recorder()

    async def run() -> list[int]:
        async with running(work, wait_s=5.0) as stage:
            late = asyncio.create_task(announced(stage, 2, read_s=0.2))
            await asyncio.sleep(0.01)  # announced before the first item arrives
            return [await stage.submit(1), await late]

    assert asyncio.run(run()) == [10, 20]
    assert work.groups == [[1, 2]]


def test_an_announcement_that_ends_without_an_item_ends_the_wait() -> None:
    work = Recorder()

    async def run() -> float:
        async with running(work, wait_s=5.0) as stage:

            async def refused() -> None:
                with stage.coming():
                    await asyncio.sleep(0.2)
                    raise ValueError("refused before it submits")

            task = asyncio.create_task(refused())
            await asyncio.sleep(0.01)
            took = await timed(stage, 1)
            with pytest.raises(ValueError, match="refused before it submits"):
                await task
            return took

    took = asyncio.run(run())
    assert 0.15 < took < 2.0, took
    assert work.groups == [[1]]


def test_arrivals_closer_than_the_wait_are_gathered_and_sparse_ones_are_not() -> None:
    async def arrivals(gap_s: float, count: int, work: Recorder) -> list[float]:
        async with running(work, wait_s=0.05) as stage:
            tasks = []
            for item in range(count):
                tasks.append(asyncio.create_task(timed(stage, item)))
                await asyncio.sleep(gap_s)
            return list(await asyncio.gather(*tasks))

    dense = Recorder()
    asyncio.run(arrivals(0.002, 200, dense))
    assert sorted(item for group in dense.groups for item in group) == list(range(200))
    # Two milliseconds apart against a 50 ms wait: once the pace is known, groups of many.
    assert len(dense.groups) < 60, [len(group) for group in dense.groups]

    sparse = Recorder()
    waits = asyncio.run(arrivals(0.2, 6, sparse))
    assert sparse.groups == [[item] for item in range(6)]
    assert max(waits) < 0.04, waits  # none waited for company that was not coming


def test_one_group_gathers_at_a_time_however_many_workers() -> None:
    # Two workers: the item arriving while the first group gathers joins it, rather than
    # being taken by the idle worker as a group of its own.
    work = Recorder()

    async def run() -> None:
        async with running(work, wait_s=5.0, workers=2) as stage:
            late = [asyncio.create_task(announced(stage, i, read_s=0.1)) for i in (1, 2)]
            await asyncio.sleep(0.01)
            await asyncio.gather(stage.submit(0), *late)

    asyncio.run(run())
    assert work.groups == [[0, 1, 2]]


def test_items_submitted_together_are_one_group_and_answered_in_order() -> None:
    work = Recorder()

    async def run() -> list[int]:
        async with running(work, wait_s=0.0) as stage:
            return await stage.submit_all([3, 1, 2])

    assert asyncio.run(run()) == [30, 10, 20]
    assert work.groups == [[3, 1, 2]]


def test_a_client_that_waits_for_each_answer_is_never_made_to_wait_for_company() -> None:
    # One caller, one submission at a time, as fast as it is answered: the arrivals are
    # close together, but none comes while another is unanswered, so none can join a group.
    work = Recorder()

    async def run() -> list[float]:
        async with running(work, wait_s=0.05) as stage:
            return [await timed(stage, item) for item in range(40)]

    waits = asyncio.run(run())
    assert work.groups == [[item] for item in range(40)]
    # Once its pace is known, a wait or two for company that does not come, then none.
    assert sum(wait > 0.04 for wait in waits) <= 2, waits
