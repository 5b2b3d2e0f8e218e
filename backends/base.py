"""The backend interface: what a backend offers the API (checks) and the worker (a runtime).

A backend is a small module with one object satisfying :class:`Backend`,
named in ``model.toml`` (``backend = "onnx"``). Its API side is torch-free:
it checks a model's files and parameters and may refine its input. Its
worker side builds a :class:`Runtime` for one version, which the batch loop
loads and drives in three stages (prepare, launch, collect).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from core.models.repository import ModelConfig, ModelVersion, Problem


@dataclass(frozen=True)
class RuntimeOptions:
    """What the worker gives every runtime it builds: where it runs and in how much memory.

    ``device``: resolved (``cpu``, ``cuda:0``). ``warmup_batch``: the largest
    batch the scheduler may send, warmed up at start-up. ``budget_bytes``:
    the memory budget when set (else the device's share, or the model's
    declared estimate on the CPU). ``cpu_threads``: how many threads a model
    on the CPU computes with.
    """

    device: str
    precision: str = "fp32"
    budget_bytes: int | None = None
    warmup_batch: int = 1
    memory_fraction: float = 0.9
    reclaim_bytes: int = 2**30
    cpu_threads: int = 0  # on the CPU: the model's threads (0: the library's default)


class Backend(Protocol):
    """One way of running a model: sentence-transformers, onnx, python, ...

    A backend may also define ``input_config(model) -> InputConfig``, the
    [input] the API checks jobs against when it is not the model's own (sim
    drops the members a model does not enable); backends.catalog uses it.

    ``input_kinds``: the [input] kinds it can take. ``uses_device``: False
    for a backend that needs no GPU whatever the machine has (``sim``), so
    ``ferry up`` starts one worker for it, not one per GPU.
    """

    name: str
    input_kinds: frozenset[str]
    uses_device: bool

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        """Problems with this version's files or the model's [parameters]; imports no torch."""
        ...

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> Runtime:
        """A runtime for ``version``, not loaded yet (the worker calls ``load``)."""
        ...


class OutOfMemory(RuntimeError):
    """The batch did not fit in the device's memory; a smaller one may.

    The loop splits the batch in two and lowers the scheduler's memory
    ceiling; it is never a failure of the jobs themselves.
    """


class DeviceLost(BaseException):
    """The device can run nothing more in this process (a sticky CUDA error).

    Not an error of the batch's jobs: the worker stops at once, leaving what
    it holds unacknowledged, and its supervisor starts it again on a fresh
    context. A job that does this every time is dead-lettered, as one that
    kills its worker is. A ``BaseException``, so that no handler meant for a
    model's errors can turn it into failed jobs.
    """


class Launched(Protocol):
    """A batch handed to the device: its copies and kernels are queued, maybe not done.

    ``wait`` blocks until the device has finished it (and measures it), and
    raises what the device raised; it may be called more than once. ``done``
    says, without waiting, whether the device has finished it (or failed: then
    ``wait`` raises).
    ``device_s`` is then the device's time for the batch and
    ``peak_memory_bytes`` its peak (None where nothing is measured).
    """

    device_s: float
    peak_memory_bytes: float | None

    def wait(self) -> None: ...

    def done(self) -> bool: ...


class Runtime(Protocol):
    """Loads a model once and runs whole batches of validated inputs.

    ``run`` returns one output per input, in order, or raises: the loop then
    bisects the batch to find the input that fails (or, for
    :class:`OutOfMemory`, halves it and tries again).

    ``run`` is ``collect(launch(prepare(inputs)))``, three stages the loop
    may also call apart: ``prepare`` is the CPU's work (tokenising, decoding,
    staging in pinned memory) and touches nothing on the device; ``launch``
    queues the batch's copies and kernels; ``collect`` waits for them and
    turns the device's output into one output per input. ``asynchronous``:
    ``launch`` returns before the device is done (a CUDA stream), so the
    loop can prepare batch N + 1 while the device computes batch N. A
    prepared batch that is never launched costs nothing but its memory.

    ``padded``: inputs are padded to the longest in the batch, so the batch's
    work is ``n x max cost``. ``declared_memory`` is ``(m0, m1)``: the model's
    own estimate of a batch's peak, ``m0 + m1 x work`` bytes.
    ``peak_memory_bytes`` is the peak measured during the last ``run`` (on a
    GPU), or ``None`` where nothing is measured.
    """

    name: str
    device: str
    padded: bool

    @property
    def asynchronous(self) -> bool: ...

    def load(self) -> None: ...

    def run(self, inputs: list[Any]) -> list[Any]: ...

    def prepare(self, inputs: list[Any]) -> Any: ...

    def launch(self, prepared: Any) -> Launched: ...

    def collect(self, launched: Any) -> list[Any]: ...

    def declared_memory(self) -> tuple[float, float]: ...

    def memory_budget_bytes(self) -> float: ...

    def calibrate(self) -> tuple[float, float, float] | None:
        """``(a, b, span)``: latency ``a + b x work`` seconds measured at start-up, or None."""
        ...

    @property
    def peak_memory_bytes(self) -> float | None: ...


def timed_best(run: Callable[[list[Any]], Any], inputs: list[Any]) -> float:
    """Seconds of the best of two runs of ``run(inputs)`` (the first of a shape may pay
    for allocation): a calibration's timing."""
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        run(inputs)
        best = min(best, time.perf_counter() - started)
    return best


def calibrated(
    run: Callable[[list[Any]], Any],
    small: list[Any],
    small_work: float,
    large: list[Any],
    large_work: float,
) -> tuple[float, float, float]:
    """``(a, b, span)`` of :meth:`Runtime.calibrate`: the line through the timings of a
    small and a large batch, ``small_work`` and ``large_work`` (the span) the work of each
    in the units of the model's cost."""
    small_s = timed_best(run, small)
    large_s = timed_best(run, large)
    slope = max(0.0, (large_s - small_s) / max(large_work - small_work, 1))
    return max(0.0, small_s - slope * small_work), slope, float(large_work)


def autocast(device: str, precision: str) -> Any:
    """The forward pass's autocast context for ``precision`` (fp32: none)."""
    import contextlib

    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def resolve_device(setting: str) -> str:
    """``auto`` means the first CUDA device when there is one, else the CPU."""
    if setting != "auto":
        return setting
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def file_problems(model: ModelConfig, version: ModelVersion, *names: str) -> list[Problem]:
    """A problem for each of ``names`` missing from the version's files."""
    problems = []
    for name in names:
        if not (version.files / name).exists():
            problems.append(
                Problem(
                    model.where(version.folder),
                    "",
                    f"{name} is missing ({model.backend} needs it; looked in {version.files})",
                )
            )
    return problems


def parameter_problems(
    model: ModelConfig, allowed: dict[str, type | tuple[type, ...]], required: tuple[str, ...] = ()
) -> list[Problem]:
    """Unknown [parameters], ones of the wrong type, and required ones missing."""
    file = model.where()
    problems = []
    for key, value in model.parameters.items():
        kind = allowed.get(key)
        if kind is None:
            names = ", ".join(sorted(allowed)) or "none"
            problems.append(
                Problem(
                    file, f"parameters.{key}", f"is not a parameter of {model.backend} ({names})"
                )
            )
        elif (
            isinstance(value, bool) and kind is not bool and bool not in _tuple(kind)
        ) or not isinstance(value, kind):
            problems.append(Problem(file, f"parameters.{key}", f"must be {_kind(kind)}"))
    for key in required:
        if key not in model.parameters:
            problems.append(Problem(file, f"parameters.{key}", "is missing"))
    return problems


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind(kind: type | tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return " or ".join(names.get(k, k.__name__) for k in _tuple(kind))


class HostRuntime:
    """A runtime that computes in ``launch``, on the host (a CPU library, a user's class).

    A subclass sets ``name``, ``device`` and ``padded`` and implements ``load``
    and ``compute`` (one output per input). ``prepare`` is ``prepare_inputs``
    (identity by default); nothing is asynchronous, so the loop overlaps only
    recording with it.
    """

    name: str
    device: str = "cpu"
    padded: bool = False
    asynchronous: bool = False
    budget_bytes: int | None = None
    cpu_budget_bytes: float = 4 * 2**30

    def load(self) -> None:
        raise NotImplementedError

    def compute(self, prepared: Any) -> list[Any]:
        raise NotImplementedError

    def prepare_inputs(self, inputs: list[Any]) -> Any:
        return inputs

    def run(self, inputs: list[Any]) -> list[Any]:
        return self.collect(self.launch(self.prepare(inputs)))

    def prepare(self, inputs: list[Any]) -> Any:
        return self.prepare_inputs(inputs)

    def launch(self, prepared: Any) -> HostLaunched:
        import time

        started = time.perf_counter()
        outputs = self.compute(prepared)
        return HostLaunched(outputs, time.perf_counter() - started)

    def collect(self, launched: HostLaunched) -> list[Any]:
        return launched.outputs

    def declared_memory(self) -> tuple[float, float]:
        return 0.0, 0.0

    def memory_budget_bytes(self) -> float:
        return float(self.budget_bytes or self.cpu_budget_bytes)

    def calibrate(self) -> tuple[float, float, float] | None:
        return None

    @property
    def peak_memory_bytes(self) -> float | None:
        return None


@dataclass
class HostLaunched:
    """A batch computed on the host: done as soon as it is launched."""

    outputs: list[Any]
    device_s: float
    peak_memory_bytes: float | None = None

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True
