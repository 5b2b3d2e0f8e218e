"""Launching ahead: batch N + 1 is claimed and prepared while batch N computes.

The sim model computes asynchronously, as a CUDA stream does: ``launch``
returns at once and ``collect`` waits for the device. These tests run the
real loop against real Redis and a real database.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest

from backends.base import DeviceLost
from backends.sim import SimRuntime
from core.config.settings import Settings
from core.db.schema import Job
from tests.integration.conftest import RunningLoop, Stack, build_sim_loop
from tests.models import with_parameters
from workers.gpu.loop import BatchLoop

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


@pytest.fixture
def slow_settings(settings: Settings) -> Settings:
    # Batches of 8 at 40 ms on the device: long enough to see what happens meanwhile.
    return with_parameters(settings, "sim", latency_base_ms=40.0)


def sim_loop(settings: Settings) -> tuple[BatchLoop, SimRuntime]:
    """A sim worker's loop and its runtime, whose steps the tests wrap."""
    loop = build_sim_loop(settings)
    assert isinstance(loop.runtime, SimRuntime)
    return loop, loop.runtime


def test_the_next_batch_is_prepared_while_the_device_computes(stack: Stack) -> None:
    # 300 ms a batch on the device: the loop's claim, prepare and launch of the next batch
    # (a database write among them) fit in it with room to spare on a loaded machine.
    slow_settings = with_parameters(stack.settings, "sim", latency_base_ms=300.0)
    loop, runtime = sim_loop(slow_settings)
    assert loop.device.ahead
    lock = threading.Lock()
    prepared: list[float] = []  # when each batch was prepared
    on_device: list[tuple[float, float]] = []  # each batch's time on the device
    events: list[tuple[str, int]] = []  # ("launch" | "collect", the batch's number)
    prepare, launch, collect = runtime.prepare, runtime.launch, runtime.collect
    # id() of a launched batch: its number. An id is reused once its batch is freed,
    # so the numbers come from a counter, not from how many ids were seen.
    numbers: dict[int, int] = {}
    counter = itertools.count()

    def timed_prepare(inputs: list[Any]) -> Any:
        with lock:
            prepared.append(runtime.clock())
        return prepare(inputs)

    def timed_launch(batch: Any) -> Any:
        launched = launch(batch)
        with lock:
            on_device.append((launched.ready_at - launched.device_s, launched.ready_at))
            numbers[id(launched)] = next(counter)
            events.append(("launch", numbers[id(launched)]))
        return launched

    def ordered_collect(launched: Any) -> Any:
        with lock:
            events.append(("collect", numbers[id(launched)]))
        return collect(launched)

    runtime.prepare = timed_prepare  # type: ignore[method-assign]
    runtime.launch = timed_launch  # type: ignore[method-assign, assignment]
    runtime.collect = ordered_collect  # type: ignore[method-assign]
    ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(48)]
    with RunningLoop(loop):
        rows = stack.wait(ids, timeout=30)
    assert {row.status for row in rows.values()} == {"succeeded"}
    assert {row.attempts for row in rows.values()} == {1}  # nothing ran twice
    assert len(on_device) >= 4
    # Batches prepared while an earlier batch was on the device.
    overlapped = [t for t in prepared if any(a < t < b for a, b in on_device)]
    assert len(overlapped) >= len(on_device) // 2, (prepared, on_device)
    # And launched before the loop waited for the one on the device: the device had the
    # next batch queued behind it (how short the gap between them is, on a machine of
    # its own, is bench/pipeline.py's to measure, not a test's).
    at = {event: position for position, event in enumerate(events)}
    queued_behind = [
        n for n in range(1, len(on_device)) if at[("launch", n)] < at[("collect", n - 1)]
    ]
    assert len(queued_behind) >= (len(on_device) - 1) // 2, events
    assert stack.pending() == 0


def test_a_job_arriving_while_a_batch_computes_rides_in_the_next_one(stack: Stack) -> None:
    # Batches of 4 at 400 ms on the device, 8 jobs queued: the second batch is full as
    # soon as the first launches. It is decided only shortly before the first ends (as
    # late as its preparation allows), so a vip job that arrives while the first computes
    # goes in it, and it is still prepared before the first ends.
    slow = with_parameters(stack.settings, "sim", latency_base_ms=400.0).model_copy(
        update={"batch_max_size": 4}
    )
    loop, runtime = sim_loop(slow)
    assert loop.device.ahead
    first_on_device = threading.Event()
    prepared: list[float] = []  # when each batch's preparation began (the runtime's clock)
    on_device: list[tuple[float, float]] = []  # each batch's time on the device
    prepare, launch = runtime.prepare, runtime.launch

    def timed_prepare(inputs: list[Any]) -> Any:
        prepared.append(runtime.clock())
        return prepare(inputs)

    def timed_launch(batch: Any) -> Any:
        launched = launch(batch)
        on_device.append((launched.ready_at - launched.device_s, launched.ready_at))
        first_on_device.set()
        return launched

    runtime.prepare = timed_prepare  # type: ignore[method-assign]
    runtime.launch = timed_launch  # type: ignore[method-assign, assignment]
    normal = [stack.submit(model="sim", input={"cost": 1}) for _ in range(8)]
    with RunningLoop(loop):
        assert first_on_device.wait(10)
        time.sleep(0.05)
        vip = stack.submit(model="sim", input={"cost": 1}, priority="vip")
        rows = stack.wait([*normal, vip], timeout=30)
    assert {row.status for row in rows.values()} == {"succeeded"}
    batches: dict[str, list[Job]] = {}
    for row in rows.values():
        batches.setdefault(str(row.batch_id), []).append(row)
    started = {batch: min(str(j.started_at) for j in jobs) for batch, jobs in batches.items()}
    order = [batches[batch] for batch in sorted(batches, key=started.__getitem__)]
    assert [len(jobs) for jobs in order] == [4, 4, 1]
    assert vip in {j.id for j in order[1]}, [[j.id == vip for j in jobs] for jobs in order]
    # The hold kept the overlap: the second batch was prepared late in the first (not at
    # once) and by its end (within 50 ms of it on a loaded host, whose read and claim may
    # outrun the margin), not after the first had been landed and recorded.
    first_began, first_ends = on_device[0]
    assert first_began + 0.2 < prepared[1] < first_ends + 0.05, (prepared, on_device)


def test_a_batch_that_cannot_be_prepared_fails_only_its_culprit(
    stack: Stack, slow_settings: Settings
) -> None:
    loop, runtime = sim_loop(slow_settings)
    prepare, launch, collect, run = runtime.prepare, runtime.launch, runtime.collect, runtime.run
    lock = threading.Lock()
    on_device: set[int] = set()  # batches launched and not yet collected
    culprit_tried = threading.Event()
    refused: list[tuple[int, bool]] = []  # (batch size, a batch on the device meanwhile)
    slices_beside_a_batch: list[bool] = []

    def picky_prepare(inputs: list[Any]) -> Any:
        if any(item["cost"] == 7 for item in inputs):
            with lock:
                refused.append((len(inputs), bool(on_device)))
            culprit_tried.set()
            raise ValueError("input 7 does not decode")
        return prepare(inputs)

    def tracked_launch(batch: Any) -> Any:
        launched = launch(batch)
        with lock:
            on_device.add(id(launched))
        return launched

    def gated_collect(launched: Any) -> Any:
        # The device holds the first batch until the loop has tried to prepare the next
        # (or 30 s pass): launching ahead is then seen whatever the machine's load.
        culprit_tried.wait(timeout=30)
        try:
            return collect(launched)
        finally:
            with lock:
                on_device.discard(id(launched))

    def watched_run(inputs: list[Any]) -> Any:
        with lock:
            slices_beside_a_batch.append(bool(on_device))
        return run(inputs)

    runtime.prepare = picky_prepare  # type: ignore[method-assign]
    runtime.launch = tracked_launch  # type: ignore[method-assign, assignment]
    runtime.collect = gated_collect  # type: ignore[method-assign]
    runtime.run = watched_run  # type: ignore[method-assign]
    # Batches of 8: the culprit is in the second, prepared while the first computes.
    ids = [stack.submit(model="sim", input={"cost": 7 if n == 11 else 1}) for n in range(24)]
    with RunningLoop(loop):
        rows = stack.wait(ids, timeout=60)
    assert rows[ids[11]].status == "failed"
    assert "ValueError: input 7 does not decode" in (rows[ids[11]].error or "")
    assert {rows[i].status for i in ids if i != ids[11]} == {"succeeded"}
    assert refused[0][0] > 1 and refused[0][1], refused  # in a batch, beside another
    # Then isolated, slice by slice, with nothing else on the device.
    assert slices_beside_a_batch and not any(slices_beside_a_batch)


def test_a_launch_out_of_memory_splits_the_batch(stack: Stack) -> None:
    # Room on the device for a batch of cost 20 at most; the scheduler is told
    # nothing of it, so it sends larger batches until it learns.
    limited = with_parameters(
        stack.settings,
        "sim",
        memory_base_bytes=0,
        memory_per_cost_bytes=2**20,
        memory_capacity_bytes=20 * 2**20,
    )
    loop = build_sim_loop(limited)
    ooms: list[int] = []
    launch = loop.runtime.launch

    def counting_launch(batch: Any) -> Any:
        try:
            return launch(batch)
        except Exception:
            ooms.append(len(batch))
            raise

    loop.runtime.launch = counting_launch  # type: ignore[method-assign, assignment]
    ids = [stack.submit(model="sim", input={"cost": 6}) for _ in range(8)]
    with RunningLoop(loop):
        rows = stack.wait(ids, timeout=30)
    assert {row.status for row in rows.values()} == {"succeeded"}
    assert ooms, "no batch ran out of memory"
    assert loop.state.memory_ceiling < float("inf")


def test_a_stopping_worker_records_the_batch_on_the_device(
    stack: Stack, slow_settings: Settings
) -> None:
    loop = build_sim_loop(slow_settings)
    running = RunningLoop(loop)
    launched: list[Any] = []
    launch = loop.runtime.launch

    def stopping_launch(batch: Any) -> Any:
        result = launch(batch)
        launched.append(result)
        running.stop.set()  # asked to stop while the batch is on the device
        return result

    loop.runtime.launch = stopping_launch  # type: ignore[method-assign, assignment]
    ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(8)]
    with running:
        running.thread.join(10)
    assert len(launched) == 1
    rows = stack.wait(ids, timeout=1)
    assert {row.status for row in rows.values()} == {"succeeded"}
    assert stack.pending() == 0
    assert loop.device.in_flight is None


def test_without_launching_ahead_each_batch_is_prepared_after_the_last_is_done(
    stack: Stack, slow_settings: Settings
) -> None:
    loop, runtime = sim_loop(slow_settings.model_copy(update={"pipeline_prepare": False}))
    assert not loop.device.ahead
    busy: list[bool] = []  # whether the device was computing when a batch was prepared
    prepare = runtime.prepare

    def watched_prepare(inputs: list[Any]) -> Any:
        busy.append(runtime._free_at > runtime.clock())
        return prepare(inputs)

    runtime.prepare = watched_prepare  # type: ignore[method-assign]
    ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(24)]
    with RunningLoop(loop):
        rows = stack.wait(ids, timeout=30)
    assert {row.status for row in rows.values()} == {"succeeded"}
    assert len(busy) >= 3 and not any(busy)


def test_a_lost_device_stops_the_worker_and_its_batch_runs_again(
    stack: Stack, slow_settings: Settings
) -> None:
    loop, runtime = sim_loop(slow_settings)
    launch = runtime.launch
    launches: list[list[int]] = []  # each batch's costs: every job's cost is its own

    class Broken:
        """The third batch's stream: the context dies under it."""

        device_s = 0.0
        peak_memory_bytes = None

        def wait(self) -> None:
            raise DeviceLost("the CUDA device is unusable: an illegal memory access")

        def done(self) -> bool:
            return True  # failed: wait() raises

    def failing_launch(batch: Any) -> Any:
        launches.append([int(item["cost"]) for item in batch])
        return Broken() if len(launches) == 3 else launch(batch)

    runtime.launch = failing_launch  # type: ignore[method-assign, assignment]
    ids = [stack.submit(model="sim", input={"cost": n + 1}) for n in range(32)]
    stop = threading.Event()
    with pytest.raises(DeviceLost):
        loop.run(stop)
    lost = set(launches[2])
    with stack.sessions() as session:
        rows = {j.id: j for j in session.query(Job).filter(Job.id.in_(ids))}
    tags = {job_id: int(rows[job_id].input["cost"]) for job_id in ids}
    # The batches before it were recorded; its own jobs were not, nor acknowledged.
    for job_id in ids:
        if tags[job_id] in set(launches[0]) | set(launches[1]):
            assert rows[job_id].status == "succeeded"
        if tags[job_id] in lost:
            assert rows[job_id].status == "running"
    assert stack.pending() >= len(lost)
    # Started again (same consumer name), the worker runs them: nothing is lost.
    with RunningLoop(build_sim_loop(slow_settings)):
        done = stack.wait(ids, timeout=30)
    assert {row.status for row in done.values()} == {"succeeded"}
    assert {done[i].attempts for i in ids if tags[i] in lost} == {2}
