"""GPU utilisation and memory from NVML, read when Prometheus scrapes a worker.

NVML (``nvidia-ml-py``, the ``pynvml`` module) needs the NVIDIA driver's
``libnvidia-ml``; where there is none (a CPU worker, a container without the
driver) nothing is registered and the worker runs as before.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)


class GpuCollector(Collector):
    """One GPU's utilisation and memory, read from NVML at every scrape."""

    def __init__(self, nvml: Any, handle: Any, model: str, gpu: str) -> None:
        self.nvml = nvml
        self.handle = handle
        self.labels = [model, gpu]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            busy = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        except Exception as exc:  # NVMLError and its many subclasses: skip this scrape
            log.debug("nvml read failed", extra={"error_type": type(exc).__name__})
            return
        families = (
            (
                "ferry_gpu_utilization_ratio",
                "Share of the last sample period the GPU was running a kernel (NVML).",
                busy.gpu / 100.0,
            ),
            (
                "ferry_gpu_memory_used_bytes",
                "GPU memory in use by every process on the device (NVML).",
                float(memory.used),
            ),
            (
                "ferry_gpu_memory_total_bytes",
                "GPU memory on the device (NVML).",
                float(memory.total),
            ),
        )
        for name, doc, value in families:
            family = GaugeMetricFamily(name, doc, labels=["model", "gpu"])
            family.add_metric(self.labels, value)
            yield family


def register_gpu_metrics(
    model: str,
    device: str,
    registry: CollectorRegistry = REGISTRY,
    nvml: Any = None,
    uuid: str | None = None,
) -> GpuCollector | None:
    """Export the worker's GPU from NVML; None (and nothing registered) without one.

    The GPU is found by its UUID, which torch and NVML agree on whatever
    ``CUDA_VISIBLE_DEVICES`` renumbers.
    """
    if not device.startswith("cuda"):
        return None
    try:
        if nvml is None:
            nvml = importlib.import_module("pynvml")
        if uuid is None:
            uuid = _torch_uuid(device)
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception as exc:  # no NVML library, no driver, an unknown device
        log.info(
            "GPU utilisation not exported (NVML unavailable)",
            extra={"model": model, "error_type": type(exc).__name__},
        )
        return None
    collector = GpuCollector(nvml, handle, model, uuid)
    registry.register(collector)
    return collector


def _torch_uuid(device: str) -> str:
    import torch

    uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
