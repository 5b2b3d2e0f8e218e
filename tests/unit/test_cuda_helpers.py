"""The CUDA helpers' logic on the CPU: pinned staging reuse, memory accounting, allocator."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from backends.base import DeviceLost
from backends.torch_runtime import DeviceMemory, PinnedStager, check_device, configure_allocator
from core.ops.metrics import GPU_MEMORY_RECLAIMS, MEMORY


def test_staging_reuses_one_buffer_and_grows_only_for_a_larger_batch() -> None:
    stager = PinnedStager(pin=False)  # pinning needs a CUDA driver; the reuse logic does not
    first = stager.stage("ids", torch.arange(12).view(3, 4))
    assert first.shape == (3, 4) and first.is_contiguous()
    assert first.tolist() == torch.arange(12).view(3, 4).tolist()
    smaller = stager.stage("ids", torch.ones(2, 5, dtype=torch.long))
    assert smaller.data_ptr() == first.data_ptr()  # the same memory, reused
    assert smaller.tolist() == [[1] * 5] * 2
    larger = stager.stage("ids", torch.zeros(5, 7, dtype=torch.long))
    assert larger.data_ptr() != first.data_ptr()
    assert stager.bytes >= 35 * 8
    again = stager.stage("ids", torch.zeros(4, 6, dtype=torch.long))
    assert again.data_ptr() == larger.data_ptr()  # grown once, reused after
    other = stager.buffer("out", (2, 3), torch.float32)
    assert other.dtype == torch.float32 and other.data_ptr() != larger.data_ptr()


def test_a_new_dtype_gets_its_own_buffer() -> None:
    stager = PinnedStager(pin=False)
    stager.stage("x", torch.zeros(4, dtype=torch.long))
    halves = stager.stage("x", torch.zeros(4, dtype=torch.float16))
    assert halves.dtype == torch.float16


class FakeCuda:
    """torch.cuda's memory counters, set by the test."""

    def __init__(self, reserved: float, allocated: float, peak: float) -> None:
        self.reserved, self.allocated, self.peak = reserved, allocated, peak
        self.fraction: float | None = None
        self.emptied = 0

    def get_device_properties(self, _device: Any) -> Any:
        return SimpleNamespace(total_memory=80 * 2**30)

    def set_per_process_memory_fraction(self, fraction: float, _device: Any) -> None:
        self.fraction = fraction

    def reset_peak_memory_stats(self, _device: Any) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self, _device: Any) -> float:
        return self.peak

    def memory_reserved(self, _device: Any) -> float:
        return self.reserved

    def memory_allocated(self, _device: Any) -> float:
        return self.allocated

    def empty_cache(self) -> None:
        self.emptied += 1
        self.reserved = self.allocated


def fake_torch(cuda: FakeCuda) -> Any:
    return SimpleNamespace(cuda=cuda, device=torch.device)


def test_the_share_is_set_and_is_the_budget() -> None:
    cuda = FakeCuda(reserved=0, allocated=0, peak=0)
    memory = DeviceMemory("cuda:0", "m-share", 0.5, 2**30, torch=fake_torch(cuda))
    assert cuda.fraction == 0.5
    assert memory.budget_bytes == 40 * 2**30


def test_fragmentation_past_the_threshold_is_given_back_and_counted() -> None:
    cuda = FakeCuda(reserved=5 * 2**30, allocated=1 * 2**30, peak=3 * 2**30)
    memory = DeviceMemory("cuda:0", "m-frag", 0.9, 2**30, torch=fake_torch(cuda))
    before = GPU_MEMORY_RECLAIMS.labels("m-frag")._value.get()
    assert memory.end_batch() == 3 * 2**30
    assert cuda.emptied == 1
    assert GPU_MEMORY_RECLAIMS.labels("m-frag")._value.get() == before + 1
    assert MEMORY.labels("m-frag", "fragmentation")._value.get() == 0
    assert MEMORY.labels("m-frag", "reserved")._value.get() == 1 * 2**30
    # Under the threshold: kept (the pool serves the next batch without asking the driver).
    cuda.reserved = cuda.allocated + 2**29
    memory.end_batch()
    assert cuda.emptied == 1
    assert MEMORY.labels("m-frag", "fragmentation")._value.get() == 2**29


def test_allocator_options_are_set_unless_the_operator_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    configure_allocator("expandable_segments:True")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    configure_allocator("expandable_segments:True")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


class AcceleratorError(RuntimeError):
    pass


def probing_torch(probe_fails: bool) -> Any:
    """A torch whose device probe works or fails, counting the probes."""
    probes: list[str] = []

    def synchronize(device: Any) -> None:
        probes.append("synchronize")
        if probe_fails:
            raise AcceleratorError("CUDA error: an illegal memory access was encountered")

    return SimpleNamespace(
        AcceleratorError=AcceleratorError,
        cuda=SimpleNamespace(synchronize=synchronize),
        ones=lambda *a, **k: torch.ones(1),
        probes=probes,
    )


def test_a_cuda_error_that_breaks_the_context_means_the_device_is_lost() -> None:
    fake = probing_torch(probe_fails=True)
    error = AcceleratorError("CUDA error: device-side assert triggered")
    with pytest.raises(DeviceLost, match="the CUDA device is unusable: CUDA error: an illegal"):
        check_device(fake, "cuda:0", error)
    assert fake.probes == ["synchronize"]
    assert issubclass(DeviceLost, BaseException) and not issubclass(DeviceLost, Exception)


@pytest.mark.parametrize(
    "error",
    [
        AcceleratorError("CUDA error: misaligned address"),  # the probe says the device is fine
        RuntimeError("CUDA error: launch failed"),  # the same, from an older torch
    ],
)
def test_a_cuda_error_the_device_survives_is_the_batchs_own(error: Exception) -> None:
    fake = probing_torch(probe_fails=False)
    check_device(fake, "cuda:0", error)  # returns: the caller re-raises the batch's error
    assert fake.probes == ["synchronize"]


def test_an_error_that_is_not_cudas_is_not_probed() -> None:
    fake = probing_torch(probe_fails=True)
    check_device(fake, "cuda:0", ValueError("shape mismatch"))
    assert fake.probes == []
