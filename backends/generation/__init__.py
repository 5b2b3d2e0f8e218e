"""The ``causal-lm`` backend: a Hugging Face causal LM folder, text generated step by step.

The version's files are what ``save_pretrained`` writes for a causal LM and
its tokenizer: ``config.json``, the weights (``model.safetensors``, or an
index of shards), ``tokenizer.json``, and ``tokenizer_config.json`` with a
chat template where the model has one. The API side (``check``) reads no
weights and imports no torch; the worker side loads the folder with the
library's ``from_pretrained`` and steps it (``backends.generation.runtime``),
or, for an architecture Ferry does not step natively, runs the library's
``generate()`` on whole batches (``backends.generation.whole``).

``[parameters]`` (all optional): ``block_size`` (tokens per KV block, 16),
``max_running`` (sequences decoding together, 64), ``step_tokens`` (tokens a
step computes at most: prefill chunks plus one per decoding sequence, 1024),
``prefill_chunk_tokens`` (the most prompt tokens one sequence prefills in a
step, 256; 0: whole prompts), ``kv_cache_bytes`` (the memory budget: on a GPU
the model and a measured step's activations come out of it and the KV pool
gets the rest; on the CPU, where nothing is measured, it is the KV pool's
alone; 0: the device's memory share, on the CPU 256 MiB), ``native``
(``auto``, or ``never`` to run even a natively stepped architecture through
``generate()``), ``prefix_caching`` (true: prompts that begin alike share the
KV blocks of their common prefix, computed once; natively stepped models
only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.base import RuntimeOptions, file_problems, parameter_problems
from core.models.repository import ModelConfig, ModelVersion, Problem

PARAMETERS: dict[str, type | tuple[type, ...]] = {
    "block_size": int,
    "max_running": int,
    "step_tokens": int,
    "prefill_chunk_tokens": int,
    "kv_cache_bytes": int,
    "native": str,
    "prefix_caching": bool,
}
CPU_KV_BYTES = 256 * 2**20
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class GenerationSettings:
    """A model's [parameters] for generation, defaults filled in."""

    block_size: int = 16
    max_running: int = 64
    step_tokens: int = 1024
    prefill_chunk_tokens: int = 256
    kv_cache_bytes: int = 0
    native: str = "auto"
    prefix_caching: bool = True

    @classmethod
    def of(cls, model: ModelConfig) -> GenerationSettings:
        known = {k: v for k, v in model.parameters.items() if k in PARAMETERS}
        return cls(**known)

    def problems(self) -> list[tuple[str, str]]:
        found = []
        for name in ("block_size", "max_running", "step_tokens"):
            if getattr(self, name) < 1:
                found.append((name, "must be at least 1"))
        if self.prefill_chunk_tokens < 0:
            found.append(("prefill_chunk_tokens", "must not be negative (0: whole prompts)"))
        if self.kv_cache_bytes < 0:
            found.append(("kv_cache_bytes", "must not be negative (0: the device's share)"))
        if self.max_running > self.step_tokens:
            found.append(("max_running", f"must not exceed step_tokens ({self.step_tokens})"))
        if self.native not in ("auto", "never"):
            found.append(("native", f"is {self.native!r}; auto or never"))
        return found


class CausalLMBackend:
    name = "causal-lm"
    input_kinds = frozenset({"generation"})
    uses_device = True

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        problems = parameter_problems(model, PARAMETERS)
        if not problems:
            for name, reason in GenerationSettings.of(model).problems():
                problems.append(Problem(model.where(), f"parameters.{name}", reason))
        # The tokenizer is input.tokenizer, whose file the repository reader checks.
        problems += file_problems(model, version, "config.json")
        if not any((version.files / name).exists() for name in WEIGHTS):
            problems.append(
                Problem(
                    model.where(version.folder),
                    "",
                    f"no weights ({' or '.join(WEIGHTS)}) in {version.files}",
                )
            )
        return problems

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> CausalLMRuntime:
        runtime = CausalLMRuntime(model.name, version.files, GenerationSettings.of(model), options)
        runtime.tokenizer_file = model.tokenizer_path(version.number)
        return runtime


class CausalLMRuntime:
    """A generation model for the worker: ``load()``, then its ``runner`` and ``limits``.

    ``execution`` is ``step`` (natively stepped, paged KV) or ``generate``
    (the library's ``generate()`` on whole batches), with ``why`` it is not
    stepped natively.
    """

    padded = False
    asynchronous = False

    def __init__(
        self, name: str, files: Path, settings: GenerationSettings, options: RuntimeOptions
    ) -> None:
        self.name = name
        self.files = files
        self.settings = settings
        self.options = options
        self.device = options.device
        self.runner: Any = None
        self.limits: Any = None
        self.execution = ""
        self.why = ""
        self.context_tokens = 0
        self.bytes_per_block = 0
        self.tokenizer_file: Path | None = None  # the model's input.tokenizer

    def load(self) -> None:
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import transformers

        from backends.generation import load as loading
        from backends.generation.runtime import StepRuntime
        from backends.generation.whole import WholeRuntime
        from scheduler.generation import GenerationLimits

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        if not self.device.startswith("cuda") and self.options.cpu_threads:
            import torch

            torch.set_num_threads(self.options.cpu_threads)
        settings = self.settings
        loaded = loading.load(
            self.files, self.device, self.options.precision, settings.native, self.tokenizer_file
        )
        dtype = loading.DTYPES[self.options.precision]
        budget = float(settings.kv_cache_bytes or self.options.budget_bytes or 0)
        if not budget:
            budget = self._device_budget() if self.device.startswith("cuda") else CPU_KV_BYTES
        if loaded.native:
            blocks, self.bytes_per_block = loading.kv_blocks(
                loaded.model, self.device, dtype, settings.block_size, budget, settings.step_tokens
            )
        else:
            per_token = loading.paged.KVShape.of(loaded.model.config, dtype).bytes_per_token
            self.bytes_per_block = per_token * settings.block_size
            blocks = int(budget // self.bytes_per_block)
        if blocks < 1:
            raise RuntimeError(
                f"no room for a KV cache: the budget of {budget:.0f} bytes leaves no block of "
                f"{self.bytes_per_block} bytes beside the model"
            )
        self.context_tokens = loaded.context_tokens
        self.execution = "step" if loaded.native else "generate"
        self.why = loaded.why_not_native
        common = dict(
            model=loaded.model,
            tokenizer=loaded.tokenizer,
            eos_ids=loaded.eos_ids,
            device=self.device,
            kv_blocks=blocks,
            block_size=settings.block_size,
        )
        if loaded.native:
            self.runner = StepRuntime(
                self.name, dtype=dtype, prefix_caching=settings.prefix_caching, **common
            )
            chunk = settings.prefill_chunk_tokens
        else:
            self.runner = WholeRuntime(self.name, **common)
            chunk = 0  # generate() prefills a prompt whole
        self.limits = GenerationLimits(
            kv_blocks=blocks,
            block_size=settings.block_size,
            max_running=settings.max_running,
            step_tokens=settings.step_tokens,
            prefill_chunk_tokens=chunk,
        )

    def _device_budget(self) -> float:
        from backends.torch_runtime import DeviceMemory

        memory = DeviceMemory(
            self.device, self.name, self.options.memory_fraction, self.options.reclaim_bytes
        )
        return memory.budget_bytes


BACKENDS = {"causal-lm": CausalLMBackend()}
