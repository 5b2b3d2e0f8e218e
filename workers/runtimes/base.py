"""What every model runtime offers the batch loop."""

from __future__ import annotations

from typing import Any, Protocol


class OutOfMemory(RuntimeError):
    """The batch did not fit in the device's memory; a smaller one may.

    The loop splits the batch in two and lowers the scheduler's memory
    ceiling; it is never a failure of the jobs themselves.
    """


class Runtime(Protocol):
    """Loads a model once and runs whole batches of validated inputs.

    ``run`` returns one output per input, in order, or raises: the loop then
    bisects the batch to find the input that fails (or, for
    :class:`OutOfMemory`, halves it and tries again).

    ``padded``: inputs are padded to the longest in the batch, so the batch's
    work is ``n x max cost``. ``declared_memory`` is ``(m0, m1)``: the model's
    own estimate of a batch's peak, ``m0 + m1 x work`` bytes.
    ``peak_memory_bytes`` is the peak measured during the last ``run`` (on a
    GPU), or ``None`` where nothing is measured.
    """

    name: str
    device: str
    padded: bool

    def load(self) -> None: ...

    def run(self, inputs: list[Any]) -> list[Any]: ...

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
