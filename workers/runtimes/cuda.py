"""What a torch runtime needs on a CUDA device: its memory share, pinned staging, its stream.

Nothing here runs on the CPU: a runtime on ``cpu`` makes none of these, and
its tensors go straight to the model.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from core.metrics import GPU_MEMORY_RECLAIMS, MEMORY
from workers.runtimes.base import OutOfMemory

log = logging.getLogger(__name__)


def configure_allocator(conf: str) -> None:
    """Set PyTorch's CUDA caching allocator options (before CUDA is first used).

    ``expandable_segments:True`` lets the pool grow in place instead of
    leaving holes of the wrong size between batches of changing shapes. A
    value already in the environment wins: the operator set it on purpose.
    """
    if conf:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", conf)


class DeviceMemory:
    """The process's share of its GPU, and what the caching allocator holds of it.

    ``fraction``: the share of the device's memory this process may allocate
    (``torch.cuda.set_per_process_memory_fraction``); past it an allocation
    raises out-of-memory, which the loop turns into a smaller batch.
    ``reclaim_bytes``: memory reserved by the allocator but not in use
    (fragmentation) beyond this is given back after a batch.
    """

    def __init__(
        self, device: str, model: str, fraction: float, reclaim_bytes: int, torch: Any = None
    ) -> None:
        if torch is None:
            import torch
        self.torch = torch
        self.device = torch.device(device)
        self.model = model
        self.fraction = fraction
        self.reclaim_bytes = reclaim_bytes
        self.total_bytes = float(torch.cuda.get_device_properties(self.device).total_memory)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    @property
    def budget_bytes(self) -> float:
        return self.total_bytes * self.fraction

    def begin_batch(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def end_batch(self) -> float:
        """The batch's peak allocation; gives back fragmented memory past the threshold."""
        cuda = self.torch.cuda
        peak = float(cuda.max_memory_allocated(self.device))
        reserved = float(cuda.memory_reserved(self.device))
        allocated = float(cuda.memory_allocated(self.device))
        if reserved - allocated > self.reclaim_bytes:
            cuda.empty_cache()
            GPU_MEMORY_RECLAIMS.labels(self.model).inc()
            log.info(
                "fragmented GPU memory given back",
                extra={"model": self.model, "bytes": round(reserved - allocated)},
            )
            reserved = float(cuda.memory_reserved(self.device))
        MEMORY.labels(self.model, "reserved").set(reserved)
        MEMORY.labels(self.model, "fragmentation").set(max(0.0, reserved - allocated))
        return peak

    def out_of_memory(self) -> None:
        """After an out-of-memory error: give the failed batch's blocks back."""
        self.torch.cuda.empty_cache()


class PinnedStager:
    """Page-locked host buffers, reused batch after batch, for non-blocking copies.

    Each named buffer grows (by doubling) to the largest batch seen and is
    then reused: a tensor is staged by copying it into the front of its
    buffer, viewed in the tensor's shape. A buffer is free again once the
    stream's event for the batch that used it has completed; the runtime
    waits for that event before it returns a batch, so one batch at a time
    may use them.
    """

    def __init__(self, pin: bool = True) -> None:
        import torch

        self.torch = torch
        self.pin = pin
        self._buffers: dict[str, Any] = {}

    def buffer(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """A view of ``name``'s buffer with this shape, contiguous, contents undefined."""
        need = 1
        for size in shape:
            need *= size
        current = self._buffers.get(name)
        if current is None or current.dtype != dtype or current.numel() < need:
            grown = max(need, 2 * current.numel() if current is not None else need)
            current = self.torch.empty(grown, dtype=dtype, pin_memory=self.pin)
            self._buffers[name] = current
        return current[:need].view(shape)

    def stage(self, name: str, tensor: Any) -> Any:
        """``tensor``'s values in ``name``'s buffer."""
        view = self.buffer(name, tuple(tensor.shape), tensor.dtype)
        view.copy_(tensor)
        return view

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class TorchRuntime:
    """What the torch runtimes share: the memory budget, the measured peak, timing.

    A subclass sets ``_memory`` (a :class:`DeviceMemory` on a CUDA device,
    else None) and runs its batches through :meth:`_measured`.
    """

    budget_bytes: int | None = None
    cpu_budget_bytes: float = 4 * 2**30
    _memory: DeviceMemory | None = None
    _peak: float | None = None

    def memory_budget_bytes(self) -> float:
        if self.budget_bytes:
            return float(self.budget_bytes)
        if self._memory is not None:
            return self._memory.budget_bytes
        return float(self.cpu_budget_bytes)

    @property
    def peak_memory_bytes(self) -> float | None:
        return self._peak

    def _measured(self, run: Callable[[], list[Any]]) -> list[Any]:
        """Run a batch; on a GPU measure its peak and turn out-of-memory into OutOfMemory."""
        self._peak = None  # a run that raises measured nothing
        if self._memory is None:
            return run()
        import torch

        try:
            self._memory.begin_batch()
            outputs = run()
            self._peak = self._memory.end_batch()
            return outputs
        except torch.cuda.OutOfMemoryError as exc:
            self._memory.out_of_memory()
            raise OutOfMemory(
                str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
            ) from exc

    def _timed(self, run: Callable[[list[Any]], list[Any]], inputs: list[Any]) -> float:
        """The best of two runs (the first of a shape may pay for allocation)."""
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            run(inputs)
            best = min(best, time.perf_counter() - started)
        return best
