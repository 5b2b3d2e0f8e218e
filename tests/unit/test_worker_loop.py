"""The worker's one loop: a step goes one way, and the loop outlives an outage.

Both kinds of worker (encoders, generation models) turn
``workers.gpu.worker_loop.WorkerLoop``; these tests drive it with a kind that
records what it is asked to do, so the order of a step and the loop's
handling of Redis going away are checked apart from any model.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import redis

from core.streams.target import RedisTarget
from workers.gpu.worker_loop import MAX_BLOCK_MS, OUTAGES, WorkerLoop, worker_redis


class _Consumer:
    model = "m"
    consumer = "c"

    def __init__(self) -> None:
        self.groups = 0

    def ensure_groups(self) -> None:
        self.groups += 1


class _Publisher:
    def __init__(self) -> None:
        self.left = False

    def leave(self) -> None:
        self.left = True


class Recorded(WorkerLoop[str, str, str]):
    """A kind that logs each call; ``fail_at`` steps raise ``failure`` from execute."""

    def __init__(
        self, stop: threading.Event, steps: int, fail_at: set[int] | None = None,
        failure: Exception | None = None,
    ) -> None:  # fmt: skip
        super().__init__(clock=lambda: 100.0)
        self.groups = _Consumer()
        self.consumer = self.groups  # type: ignore[assignment]
        self.publisher = _Publisher()  # type: ignore[assignment]
        self.calls: list[Any] = []
        self.stop = stop
        self.left = steps
        self.fail_at = fail_at or set()
        self.failure = failure or redis.ConnectionError("gone")
        self.turn = 0

    @property
    def held_count(self) -> int:
        return 0

    def upkeep(self) -> None:
        self.turn += 1
        self.calls.append("upkeep")

    def read(self, block_ms: int | None) -> None:
        self.calls.append(("read", block_ms))

    def schedule(self, now: float) -> str:
        self.calls.append(("schedule", now))
        return f"plan{self.turn}"

    def start(self, plan: str) -> None:
        self.calls.append(("start", plan))

    def execute(self, plan: str) -> str:
        if self.turn in self.fail_at:
            raise self.failure
        self.calls.append(("execute", plan))
        return f"output{self.turn}"

    def update_from_output(self, plan: str, output: str) -> str:
        self.calls.append(("update", plan, output))
        return f"events{self.turn}"

    def apply(self, events: str) -> None:
        self.calls.append(("apply", events))
        self.left -= 1
        if self.left <= 0:
            self.stop.set()

    def ran(self, plan: str) -> bool:
        return plan != "plan1"

    def next_wait_ms(self, plan: str) -> int | None:
        return None if self.turn % 2 else 250

    def forget(self) -> None:
        self.calls.append("forget")

    def finish_running(self) -> None:
        self.calls.append("finish_running")

    def close(self) -> None:
        self.calls.append("close")

    def request_stop(self) -> None:
        self.stop.set()


def test_a_step_goes_one_way_and_the_plan_and_output_travel_through_it() -> None:
    stop = threading.Event()
    loop = Recorded(stop, steps=2)
    loop.run(stop)

    def numbered(n: int, block_ms: int | None) -> list[Any]:
        plan, output, events = f"plan{n}", f"output{n}", f"events{n}"
        return [
            "upkeep", ("read", block_ms), ("schedule", 100.0), ("start", plan),
            ("execute", plan), ("update", plan, output), ("apply", events),
        ]  # fmt: skip

    # The first read may wait the longest; the next waits what the step before asked for.
    assert loop.calls == [
        *numbered(1, MAX_BLOCK_MS), *numbered(2, None), "finish_running", "close",
    ]  # fmt: skip
    assert loop.steps == 1  # the first plan ran nothing on the device
    assert loop.groups.groups == 1
    assert loop.publisher.left and not loop.ready.is_set()  # type: ignore[attr-defined]


def test_an_outage_forgets_what_is_held_and_the_loop_goes_on() -> None:
    stop = threading.Event()
    loop = Recorded(stop, steps=1, fail_at={1})
    waited: list[float | None] = []
    real_wait = stop.wait

    def no_backoff(timeout: float | None = None) -> bool:
        waited.append(timeout)
        return real_wait(0)

    stop.wait = no_backoff  # type: ignore[method-assign]
    loop.run(stop)
    assert loop.calls[:3] == ["upkeep", ("read", MAX_BLOCK_MS), ("schedule", 100.0)]
    assert loop.calls[4] == "forget"  # after start, before anything is applied
    assert ("execute", "plan1") not in loop.calls and ("apply", "events2") in loop.calls
    assert waited and waited[0] == pytest.approx(0.5)  # backed off before trying again
    assert loop.calls[-2:] == ["finish_running", "close"]


def test_what_is_not_an_outage_stops_the_loop_but_still_closes_it() -> None:
    stop = threading.Event()
    loop = Recorded(stop, steps=3, fail_at={2}, failure=RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        loop.run(stop)
    assert "forget" not in loop.calls
    assert loop.calls[-1] == "close"  # close runs, finish_running does not
    assert "finish_running" not in loop.calls
    assert loop.publisher.left  # type: ignore[attr-defined]


def test_the_workers_redis_client_gives_up_on_a_server_that_never_answers() -> None:
    # A host cut off without a reset leaves a connection that accepts and never
    # answers: a worker's command must end in a timeout (an outage the loop rides
    # out), never wait on it for good.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    port = silent.getsockname()[1]
    try:
        client = worker_redis(RedisTarget(url=f"redis://127.0.0.1:{port}/0"), reply_timeout_s=0.3)
        with pytest.raises(redis.TimeoutError):
            client.ping()
        assert isinstance(redis.TimeoutError("x"), OUTAGES)
    finally:
        silent.close()
