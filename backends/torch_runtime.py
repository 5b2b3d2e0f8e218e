"""What a torch runtime needs on a CUDA device: its memory share, pinned staging, its stream.

Nothing here runs on the CPU: a runtime on ``cpu`` makes none of these, and
its tensors go straight to the model.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from backends.base import DeviceLost, OutOfMemory, RuntimeOptions, calibrated
from core.ops.metrics import GPU_MEMORY_RECLAIMS, MEMORY

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
    """What the torch runtimes share: the three stages, the memory budget, timing.

    A subclass loads ``_model`` and sets ``_stream`` and ``_memory`` (a
    :class:`DeviceMemory`) on a CUDA device, and says how a batch is made:
    ``_host_inputs`` (the CPU's work, staging into the given buffers when
    there are some), ``_forward`` (the model on the device's tensors) and
    ``_outputs`` (the output tensor, on the host, to one output per input).

    On a CUDA device each batch in preparation or on the device has its own
    set of pinned buffers, so batch N + 1 can be staged while batch N's
    copies are still in flight; a set is reused once its batch is collected.
    """

    name: str
    cpu_budget_bytes: float = 4 * 2**30

    def __init__(self, options: RuntimeOptions) -> None:
        self.device = options.device
        self.precision = options.precision
        self.budget_bytes = options.budget_bytes
        self.warmup_batch = options.warmup_batch
        self.memory_fraction = options.memory_fraction
        self.reclaim_bytes = options.reclaim_bytes
        self.cpu_threads = options.cpu_threads
        self._model: Any = None
        self._weights_bytes = 0
        # On a CUDA device only: the model's own stream and its memory share.
        self._stream: Any = None
        self._memory: DeviceMemory | None = None
        self._peak: float | None = None
        self._spare: list[PinnedStager] = []  # pinned buffer sets not in use

    def _take_device(self) -> None:
        """On a CUDA device: the process's memory share and the model's stream.

        Called before the weights are loaded: they already count against the share.
        On the CPU: the threads the model computes with (FERRY_CPU_THREADS).
        """
        import torch

        if not self.device.startswith("cuda"):
            if self.cpu_threads:
                torch.set_num_threads(self.cpu_threads)
            return

        self._memory = DeviceMemory(
            self.device, self.name, self.memory_fraction, self.reclaim_bytes
        )
        self._stream = torch.cuda.Stream(device=torch.device(self.device))

    @property
    def asynchronous(self) -> bool:
        return self._stream is not None

    def memory_budget_bytes(self) -> float:
        if self.budget_bytes:
            return float(self.budget_bytes)
        if self._memory is not None:
            return self._memory.budget_bytes
        return float(self.cpu_budget_bytes)

    @property
    def peak_memory_bytes(self) -> float | None:
        """The peak of the last batch waited for (on a GPU; None on the CPU)."""
        return self._peak

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held in buffer sets not in use (0 on the CPU)."""
        return sum(stager.bytes for stager in self._spare)

    def run(self, inputs: list[Any]) -> list[Any]:
        return self.collect(self.launch(self.prepare(inputs)))

    def prepare(self, inputs: list[Any]) -> Prepared:
        if self._model is None:
            raise RuntimeError("model not loaded")
        stager = None
        if self._stream is not None:
            stager = self._spare.pop() if self._spare else PinnedStager()
        return Prepared(self._host_inputs(inputs, stager), stager)

    def launch(self, prepared: Prepared) -> TorchLaunched:
        """On a GPU: queue the copies, the kernels and the copy back on the model's stream."""
        import torch

        self._peak = None  # a launch that raises measured nothing
        if self._stream is None or self._memory is None or prepared.stager is None:
            started = time.perf_counter()
            with torch.inference_mode():
                result = self._forward(*prepared.tensors)
            return TorchLaunched(self, result, None, device_s=time.perf_counter() - started)
        stager = prepared.stager
        device = torch.device(self.device)
        try:
            self._memory.begin_batch()
            # Every copy and kernel on the model's stream, never the default one.
            with torch.inference_mode(), torch.cuda.stream(self._stream):
                began = torch.cuda.Event(enable_timing=True)
                began.record(self._stream)
                on_device = [t.to(device, non_blocking=True) for t in prepared.tensors]
                result = self._forward(*on_device)
                host = stager.buffer("out", tuple(result.shape), result.dtype)
                host.copy_(result, non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record(self._stream)
        except torch.cuda.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
        except Exception as exc:
            check_device(torch, device, exc)
            raise
        else:
            return TorchLaunched(self, host, stager, events=(began, done))
        # Out of the except block, and raised without the error as its cause:
        # its traceback holds the forward's frames, and they the activations
        # computed before memory ran out. Kept, the cache could not give them
        # back, and the smaller batches retried next would find no room.
        on_device, result = [], None
        self._stream.synchronize()  # copies already queued may still read the buffers
        self._spare.append(stager)  # once the stream is done with them, they serve the next batch
        self._memory.out_of_memory()
        raise OutOfMemory(message)

    def collect(self, launched: TorchLaunched) -> list[Any]:
        launched.wait()
        try:
            return self._outputs(launched.result)
        finally:
            if launched.stager is not None:  # its buffers are free again
                self._spare.append(launched.stager)

    def _warm_up(self, small: Any, largest: Any) -> None:
        """Pay for lazy initialisation before traffic; on a GPU, fill the pools too.

        ``small`` is run alone. On a GPU, a batch of ``warmup_batch`` (the
        largest the scheduler may send) of ``largest`` then runs as the
        pipelined loop runs it, two staged and one at a time on the device, so
        the allocator's pool and both sets of pinned buffers reach their full
        size now, not under the first burst of traffic.
        """
        self.run([small])
        if self._stream is None or self.warmup_batch <= 1:
            return
        inputs = [largest] * self.warmup_batch
        first, second = self.prepare(inputs), self.prepare(inputs)
        self.collect(self.launch(first))
        self.collect(self.launch(second))

    def _host_inputs(self, inputs: list[Any], stager: PinnedStager | None) -> list[Any]:
        raise NotImplementedError

    def _forward(self, *tensors: Any) -> Any:
        raise NotImplementedError

    def _outputs(self, result: Any) -> list[Any]:
        raise NotImplementedError


def calibrate_text(runtime: Any, longest: str) -> tuple[float, float, float]:
    """``(a, b, span)`` for a padded text model: a short and a long batch, timed.

    ``runtime`` has ``run``, ``_tokenizer`` and ``max_tokens``;
    ``longest`` is a text of about ``max_tokens`` tokens.
    """
    short = "a short sentence"
    span_items = 16
    return calibrated(
        runtime.run,
        [short],
        len(runtime._tokenizer.encode(short).ids),
        [longest] * span_items,
        span_items * runtime.max_tokens,
    )


def check_device(torch: Any, device: Any, exc: BaseException) -> None:
    """After ``exc`` from CUDA work: raise :class:`DeviceLost` if the device is now unusable.

    A CUDA error (an illegal memory access, a device-side assert) leaves the
    context broken: every later call fails the same way. A small probe tells
    it apart from an error of the batch alone.
    """
    accelerator_error = getattr(torch, "AcceleratorError", ())
    if not (isinstance(exc, accelerator_error) or "CUDA error" in str(exc)):
        return
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as probe:
        first = (str(probe) or type(probe).__name__).splitlines()[0]
        raise DeviceLost(f"the CUDA device is unusable: {first}") from exc


def staged(stager: PinnedStager | None, name: str, tensor: Any) -> Any:
    """``tensor`` in ``stager``'s pinned buffer ``name``, or itself without a stager."""
    return tensor if stager is None else stager.stage(name, tensor)


@dataclass
class Prepared:
    """A batch's inputs on the host (pinned on a GPU), ready to launch."""

    tensors: list[Any]
    stager: PinnedStager | None


@dataclass(eq=False)
class TorchLaunched:
    """A batch queued on the model's stream (or, on the CPU, already computed)."""

    runtime: TorchRuntime
    result: Any
    stager: PinnedStager | None
    events: tuple[Any, Any] | None = None
    device_s: float = 0.0
    peak_memory_bytes: float | None = field(init=False, default=None)

    def done(self) -> bool:
        """Whether this stream's work is done; an error of the device's counts as done
        (``wait`` raises it)."""
        if self.events is None:
            return True
        try:
            return bool(self.events[1].query())
        except Exception:
            return True

    def wait(self) -> None:
        """Until this stream's work is done (not the device's); then time and measure it."""
        if self.events is None:
            return
        began, done = self.events
        try:
            done.synchronize()
        except Exception as exc:
            import torch

            check_device(torch, torch.device(self.runtime.device), exc)
            raise
        self.events = None
        self.device_s = began.elapsed_time(done) / 1000.0
        memory = self.runtime._memory
        if memory is not None:
            self.peak_memory_bytes = memory.end_batch()
            self.runtime._peak = self.peak_memory_bytes
