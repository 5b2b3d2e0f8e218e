"""The simulated accelerator, with the sleep injected (nothing really sleeps)."""

from __future__ import annotations

from typing import Any

import pytest

from backends.base import OutOfMemory
from backends.sim import SimRuntime, SimulatedFailure


class FakeTime:
    """A clock that moves only when the runtime sleeps (or a test says so)."""

    def __init__(self, slept: list[float]) -> None:
        self.now = 1000.0
        self.slept = slept

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def runtime(slept: list[float], base_ms: float = 20.0, per_cost_ms: float = 0.5) -> SimRuntime:
    time = FakeTime(slept)
    return SimRuntime(
        latency_base_ms=base_ms,
        latency_per_cost_ms=per_cost_ms,
        memory_base_bytes=64 * 2**20,
        memory_per_cost_bytes=2**20,
        sleep=time.sleep,
        clock=lambda: time.now,
    )


@pytest.mark.parametrize(
    ("base_ms", "per_cost_ms", "costs", "seconds"),
    [
        (20.0, 0.5, [1], 0.0205),
        (20.0, 0.5, [4, 6], 0.025),
        (0.0, 1.0, [100, 200, 700], 1.0),
        (5.0, 0.0, [1000], 0.005),
        (0.0, 0.0, [1], 0.0),
    ],
)
def test_latency_formula_is_slept(
    base_ms: float, per_cost_ms: float, costs: list[int], seconds: float
) -> None:
    slept: list[float] = []
    sim = runtime(slept, base_ms, per_cost_ms)
    sim.run([{"cost": c} for c in costs])
    assert slept == ([pytest.approx(seconds)] if seconds else [])
    assert sim.latency_ms(sum(costs)) == pytest.approx(seconds * 1000)


@pytest.mark.parametrize(("batch_cost", "expected"), [(0, 64 * 2**20), (10, 74 * 2**20)])
def test_memory_formula(batch_cost: int, expected: int) -> None:
    assert runtime([]).memory_bytes(batch_cost) == expected


@pytest.mark.parametrize(
    ("inputs", "outputs"),
    [
        ([{"cost": 3}], [{"cost": 3}]),
        ([{"cost": 1, "fail": False}, {"cost": 2}], [{"cost": 1}, {"cost": 2}]),
        ([{"cost": "5"}], [{"cost": 5}]),
    ],
)
def test_outputs_echo_the_cost_in_order(
    inputs: list[dict[str, Any]], outputs: list[dict[str, Any]]
) -> None:
    assert runtime([]).run(inputs) == outputs


@pytest.mark.parametrize("position", [0, 2])
def test_fail_raises_simulated_failure_after_the_batch_time(position: int) -> None:
    slept: list[float] = []
    inputs: list[dict[str, Any]] = [{"cost": 2}, {"cost": 2}, {"cost": 2}]
    inputs[position]["fail"] = True
    with pytest.raises(SimulatedFailure, match=f"batch position {position}"):
        runtime(slept).run(inputs)
    assert slept == [pytest.approx(0.023)]


def test_simulated_failure_is_a_runtime_error() -> None:
    assert issubclass(SimulatedFailure, RuntimeError)


def test_load_needs_nothing() -> None:
    slept: list[float] = []
    sim = runtime(slept)
    sim.load()
    assert slept == []
    assert (sim.name, sim.device) == ("sim", "sim")


@pytest.mark.parametrize(("costs", "fits"), [([32, 32], True), ([32, 33], False), ([1], True)])
def test_a_capacity_makes_large_batches_run_out_of_memory(costs: list[int], fits: bool) -> None:
    slept: list[float] = []
    sim = runtime(slept)
    sim.memory_capacity_bytes = 64 * 2**20 + 64 * 2**20  # 64 units of cost
    inputs: list[Any] = [{"cost": c} for c in costs]
    if fits:
        assert sim.run(inputs) == [{"cost": c} for c in costs]
    else:
        with pytest.raises(OutOfMemory, match="simulated out of memory"):
            sim.run(inputs)
        assert slept == []  # it failed before using the device


def test_sim_declares_its_latency_and_memory() -> None:
    sim = runtime([], base_ms=20.0, per_cost_ms=0.5)
    assert sim.calibrate() == (0.020, 0.0005, 1000.0)
    assert sim.declared_memory() == (64 * 2**20, 2**20)
    assert sim.peak_memory_bytes is None and not sim.padded


def test_a_launch_returns_at_once_and_batches_queue_like_a_stream() -> None:
    slept: list[float] = []
    sim = runtime(slept, base_ms=10.0, per_cost_ms=1.0)
    first = sim.launch(sim.prepare([{"cost": 10}]))  # 20 ms
    second = sim.launch(sim.prepare([{"cost": 20}, {"cost": 10}]))  # 40 ms, after the first
    assert slept == []  # the worker was free to go on
    assert (first.device_s, second.device_s) == (pytest.approx(0.020), pytest.approx(0.040))
    assert sim.collect(first) == [{"cost": 10}]
    assert slept == [pytest.approx(0.020)]
    assert sim.collect(second) == [{"cost": 20}, {"cost": 10}]
    assert sum(slept) == pytest.approx(0.060)  # the second started when the first was done
    assert sim.asynchronous


def test_work_done_while_the_device_computes_is_not_waited_for_again() -> None:
    slept: list[float] = []
    sim = runtime(slept, base_ms=30.0, per_cost_ms=0.0)
    clock = sim.clock
    launched = sim.launch(sim.prepare([{"cost": 1}]))
    later = clock() + 0.025  # the worker spent 25 ms preparing the next batch
    sim.clock = lambda: later
    sim.collect(launched)
    assert slept == [pytest.approx(0.005)]


def test_preparing_costs_the_cpu_what_it_is_told_and_the_device_nothing() -> None:
    import time

    slept: list[float] = []
    sim = runtime(slept)
    sim.prepare_ms_per_item = 2.0
    started = time.perf_counter()
    prepared = sim.prepare([{"cost": 1}] * 10)
    assert time.perf_counter() - started >= 0.020
    assert prepared == [{"cost": 1}] * 10 and slept == []
