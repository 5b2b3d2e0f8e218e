"""run_isolating: every input gets exactly one outcome, whatever fails."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest

from backends.base import OutOfMemory
from workers.gpu.execute import ItemResult, run_isolating


class PoisonError(RuntimeError):
    pass


class Model:
    """Doubles its inputs; raises for any batch holding a poison input."""

    def __init__(self, poison: set[int] | None = None) -> None:
        self.poison = poison or set()
        self.calls: list[list[int]] = []

    def __call__(self, inputs: list[Any]) -> list[Any]:
        self.calls.append(list(inputs))
        for value in inputs:
            if value in self.poison:
                raise PoisonError(f"cannot take input {value}")
        return [value * 2 for value in inputs]


class Ticks:
    """A clock that advances by ``step`` seconds on every reading."""

    def __init__(self, step: float = 0.01) -> None:
        self.now = 100.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def outcomes(results: list[ItemResult]) -> list[tuple[bool, Any, str | None]]:
    return [(r.ok, r.output, r.error) for r in results]


def test_empty_batch_runs_nothing() -> None:
    model = Model()
    assert run_isolating(model, [], clock=Ticks()) == []
    assert model.calls == []


def test_all_succeed_in_one_call() -> None:
    model = Model()
    readings = iter([10.0, 10.25])
    results = run_isolating(model, [1, 2, 3, 4], clock=lambda: next(readings))
    assert outcomes(results) == [(True, 2, None), (True, 4, None), (True, 6, None), (True, 8, None)]
    assert model.calls == [[1, 2, 3, 4]]
    assert [r.inference_ms for r in results] == [pytest.approx(250.0)] * 4


@pytest.mark.parametrize(
    ("poison", "size"),
    [
        ({0}, 8),
        ({3}, 8),
        ({7}, 8),
        ({2, 5}, 8),
        ({0, 1}, 8),
        ({6, 7}, 8),
        ({4}, 5),
        ({1, 3, 5}, 7),
        (set(range(8)), 8),
    ],
)
def test_poison_inputs_fail_alone(poison: set[int], size: int) -> None:
    inputs = list(range(size))
    results = run_isolating(Model(poison), inputs, clock=Ticks())
    assert len(results) == size
    for value, result in zip(inputs, results, strict=True):
        if value in poison:
            assert result == ItemResult(
                ok=False,
                error=f"PoisonError: cannot take input {value}",
                inference_ms=result.inference_ms,
            )
        else:
            assert (result.ok, result.output, result.error) == (True, value * 2, None)


def test_bisection_halves_until_the_poison_is_alone() -> None:
    model = Model({5})
    run_isolating(model, list(range(8)), clock=Ticks())
    assert model.calls == [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [4, 5],
        [4],
        [5],
        [6, 7],
    ]


def test_single_input_batch_that_raises() -> None:
    readings = iter([1.0, 1.5])
    results = run_isolating(Model({9}), [9], clock=lambda: next(readings))
    assert results == [
        ItemResult(ok=False, error="PoisonError: cannot take input 9", inference_ms=500.0)
    ]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (lambda inputs: inputs[:-1], "RuntimeError: model returned 0 outputs for 1 inputs"),
        (lambda inputs: [*inputs, None], "RuntimeError: model returned 2 outputs for 1 inputs"),
        (lambda inputs: [], "RuntimeError: model returned 0 outputs for 1 inputs"),
    ],
    ids=["one-short", "one-extra", "none"],
)
def test_output_count_mismatch_fails_every_input_with_a_clear_message(
    model: Callable[[list[Any]], list[Any]], message: str
) -> None:
    results = run_isolating(model, ["a", "b", "c"], clock=Ticks())
    assert outcomes(results) == [(False, None, message)] * 3


def test_output_count_mismatch_only_in_large_batches_recovers() -> None:
    def model(inputs: list[Any]) -> list[Any]:
        out = [value.upper() for value in inputs]
        return out[:2]  # silently drops everything past the second

    results = run_isolating(model, ["a", "b", "c", "d", "e"], clock=Ticks())
    assert outcomes(results) == [(True, v, None) for v in ["A", "B", "C", "D", "E"]]


@pytest.mark.parametrize(
    ("exc", "error"),
    [
        (ValueError("bad"), "ValueError: bad"),
        (ValueError("  padded  "), "ValueError: padded"),
        (RuntimeError(), "RuntimeError: no message"),
        (KeyError("k"), "KeyError: 'k'"),
    ],
)
def test_error_message_names_the_exception(exc: Exception, error: str) -> None:
    def model(inputs: list[Any]) -> list[Any]:
        raise exc

    [result] = run_isolating(model, ["x"], clock=Ticks())
    assert (result.ok, result.error) == (False, error)


def test_long_error_message_is_capped() -> None:
    def model(inputs: list[Any]) -> list[Any]:
        raise ValueError("x" * 10_000)

    [result] = run_isolating(model, ["x"], clock=Ticks())
    assert result.error is not None
    assert len(result.error) == 2000
    assert result.error.startswith("ValueError: xxx")


class SmallDevice:
    """Runs out of memory for any batch whose sum exceeds ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.calls: list[list[int]] = []

    def __call__(self, inputs: list[Any]) -> list[Any]:
        self.calls.append(list(inputs))
        if sum(inputs) > self.capacity:
            raise OutOfMemory(f"needs {sum(inputs)}, has {self.capacity}")
        return [value * 2 for value in inputs]


def test_out_of_memory_halves_the_batch_until_it_fits() -> None:
    device = SmallDevice(capacity=20)
    told: list[tuple[int, int]] = []
    results = run_isolating(
        device, [5, 5, 5, 5, 5, 5, 5, 5], on_oom=lambda a, b: told.append((a, b))
    )
    assert [r.ok for r in results] == [True] * 8  # nobody fails for it
    assert [r.output for r in results] == [10] * 8
    assert told == [(0, 8)]  # the whole batch did not fit; each half did
    assert device.calls[1:] == [[5, 5, 5, 5], [5, 5, 5, 5]]


def test_an_input_too_large_even_alone_fails_with_that_reason() -> None:
    results = run_isolating(SmallDevice(capacity=20), [5, 50, 5])
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].error is not None
    assert "OutOfMemory" in results[1].error and "even alone" in results[1].error


class HeldMemory:
    """A device whose failed attempts keep their memory while their frames live.

    As on a GPU: the activations a batch computed before it ran out of memory
    are locals of the forward's frames, which the error's traceback holds.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live: weakref.WeakSet[Activations] = weakref.WeakSet()

    def __call__(self, inputs: list[int]) -> list[int]:
        return self.forward(inputs)

    def forward(self, inputs: list[int]) -> list[int]:
        in_use = sum(held.size for held in self.live)
        activations = Activations(sum(inputs))
        self.live.add(activations)
        if in_use + activations.size > self.capacity:
            raise OutOfMemory(f"needs {activations.size}, {in_use} of {self.capacity} in use")
        return [value * 2 for value in inputs]


class Activations:
    def __init__(self, size: int) -> None:
        self.size = size


def test_the_failed_batch_no_longer_holds_memory_when_its_halves_run() -> None:
    device = HeldMemory(capacity=20)
    results = run_isolating(device, [5, 5, 5, 5, 5, 5, 5, 5])
    # Were the first attempt's error still alive, its 40 would fill the device
    # and every half, down to each input alone, would fail.
    assert [r.ok for r in results] == [True] * 8, [r.error for r in results]


def test_a_batch_that_failed_when_launched_ahead_no_longer_holds_memory() -> None:
    device = HeldMemory(capacity=20)
    try:
        device([5] * 8)
    except OutOfMemory as exc:
        failed: OutOfMemory | None = exc
    results = run_isolating(device, [5] * 8, failed=failed)
    assert all(r.ok for r in results), [r.error for r in results]
