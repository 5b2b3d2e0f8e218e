"""The pipelined loop: batch N is recorded on its own thread while batch N + 1 runs."""

from __future__ import annotations

import threading
import time
from typing import Any

import redis

from tests.integration.conftest import RunningLoop, Stack, build_sim_loop


def test_the_next_batch_runs_while_the_last_one_is_recorded(stack: Stack) -> None:
    loop = build_sim_loop(stack.settings)
    spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def timed(kind: str, call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.monotonic()
            try:
                return call(*args, **kwargs)
            finally:
                with lock:
                    spans.append((kind, began, time.monotonic()))

        return wrapper

    finish = loop.recorder.finish

    def slow_finish(outcomes: Any, *args: Any, **kwargs: Any) -> Any:
        if not outcomes:  # the main thread's check for expired jobs: nothing to write
            return finish(outcomes, *args, **kwargs)
        time.sleep(0.1)  # a slow database
        return timed("record", finish)(outcomes, *args, **kwargs)

    loop.recorder.finish = slow_finish  # type: ignore[method-assign]
    launch = loop.runtime.launch

    def timed_launch(batch: Any) -> Any:
        launched: Any = launch(batch)  # the sim device's own account of the batch
        with lock:
            spans.append(("compute", launched.ready_at - launched.device_s, launched.ready_at))
        return launched

    loop.runtime.launch = timed_launch  # type: ignore[method-assign, assignment]
    ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(40)]
    with RunningLoop(loop):
        rows = stack.wait(ids, timeout=30)
    assert {row.status for row in rows.values()} == {"succeeded"}
    records = [(a - 0.1, b) for kind, a, b in spans if kind == "record"]  # with the sleep
    computes = [(a, b) for kind, a, b in spans if kind == "compute"]
    assert len(computes) >= 3
    # Batches computed while an earlier one was being recorded: their spans overlap (a
    # compute may begin a moment before its recording thread takes the batch before it;
    # run one after the other, no compute would overlap any recording).
    overlapped = [c for c in computes if any(c[0] < r1 and r0 < c[1] for r0, r1 in records)]
    assert len(overlapped) >= 2, (records, computes)
    assert stack.pending() == 0


def test_a_recording_that_fails_leaves_its_jobs_to_run_again(stack: Stack) -> None:
    loop = build_sim_loop(stack.settings)
    ack = loop.consumer.ack
    failures: list[int] = []

    def flaky_ack(entries: Any, publish: Any = None) -> None:
        if not failures:
            failures.append(len(entries))
            raise redis.ConnectionError("Redis went away mid-acknowledgement")
        ack(entries, publish)

    loop.consumer.ack = flaky_ack  # type: ignore[method-assign]
    ids = [stack.submit(model="sim", input={"cost": 1}) for _ in range(20)]
    with RunningLoop(loop):
        rows = stack.wait(ids, timeout=30)
        deadline = time.monotonic() + 10
        while stack.pending():
            assert time.monotonic() < deadline, "entries left unacknowledged"
            time.sleep(0.05)
    assert failures, "the acknowledgement never failed"
    assert {row.status for row in rows.values()} == {"succeeded"}
    # No batch was thrown away for it: every job was started once.
    assert {row.attempts for row in rows.values()} == {1}
