"""Model runtimes: they load, preprocess, run and postprocess."""

from __future__ import annotations

from typing import Any

from core.settings import Settings
from workers.runtimes.base import OutOfMemory, Runtime, resolve_device


def load_runtime(model: str, settings: Settings, device: str | None = None) -> Runtime:
    """Build and load the runtime of one catalog model."""
    runtime: Runtime
    if model == "sim":
        from workers.runtimes.sim import SimRuntime

        runtime = SimRuntime(
            latency_base_ms=settings.sim_latency_base_ms,
            latency_per_cost_ms=settings.sim_latency_per_cost_ms,
            memory_base_bytes=settings.sim_memory_base_bytes,
            memory_per_cost_bytes=settings.sim_memory_per_cost_bytes,
            memory_capacity_bytes=settings.sim_memory_capacity_bytes,
            prepare_ms_per_item=settings.sim_prepare_ms_per_item,
            budget_bytes=settings.memory_budget_bytes,
        )
    elif model == "minilm":
        from workers.runtimes.minilm import MiniLMRuntime

        runtime = MiniLMRuntime(max_tokens=settings.minilm_max_tokens, **_torch(settings, device))
    elif model == "resnet50":
        from workers.runtimes.resnet50 import ResNet50Runtime

        runtime = ResNet50Runtime(
            weights=settings.resnet50_weights,
            random_weights=settings.resnet50_random_weights,
            image_size=settings.resnet50_image_size,
            decode_threads=settings.resnet50_decode_threads,
            **_torch(settings, device),
        )
    else:
        raise ValueError(f"no runtime for model {model!r}")
    runtime.load()
    return runtime


def _torch(settings: Settings, device: str | None) -> dict[str, Any]:
    """What every torch runtime is built with: its device, precision and memory."""
    return {
        "device": resolve_device(device or settings.device),
        "precision": settings.precision,
        "budget_bytes": settings.memory_budget_bytes,
        # The largest batch the scheduler may send: warmed up at start-up.
        "warmup_batch": settings.batch_max_size,
        "memory_fraction": settings.gpu_memory_fraction,
        "reclaim_bytes": settings.gpu_reclaim_bytes,
    }


__all__ = ["OutOfMemory", "Runtime", "load_runtime"]
