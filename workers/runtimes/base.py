"""What every model runtime offers the batch loop."""

from __future__ import annotations

from typing import Any, Protocol


class Runtime(Protocol):
    """Loads a model once and runs whole batches of validated inputs.

    ``run`` returns one output per input, in order, or raises: the loop then
    bisects the batch to find the input that fails.
    """

    name: str
    device: str

    def load(self) -> None: ...

    def run(self, inputs: list[Any]) -> list[Any]: ...


def resolve_device(setting: str) -> str:
    """``auto`` means the first CUDA device when there is one, else the CPU."""
    if setting != "auto":
        return setting
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"
