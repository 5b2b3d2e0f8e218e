"""What every model runtime offers the batch loop."""

from __future__ import annotations

from typing import Any, Protocol


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
    raises what the device raised; it may be called more than once.
    ``device_s`` is then the device's time for the batch and
    ``peak_memory_bytes`` its peak (None where nothing is measured).
    """

    device_s: float
    peak_memory_bytes: float | None

    def wait(self) -> None: ...


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
