"""Loading a causal LM folder for the worker: the model, its tokenizer, and its KV pool.

``from_pretrained`` on the version's folder is the library's own loading
code. Architectures whose attention goes through the library's attention
interface and whose positions are plain (:data:`NATIVE`) are stepped
natively, with paged attention; any other causal LM runs through the
library's ``generate()`` on whole batches (``backends.generation.whole``).

The KV pool is the rest of the memory budget once the model is loaded and
a full step's activations are measured: ``blocks = (M_avail - M_model -
M_step) / bytes_per_block``, each measured on the device (allocated bytes
before and after) where the device can say, else computed from the shapes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backends.generation import paged

log = logging.getLogger(__name__)

# model_type values whose modeling code Ferry steps natively: attention
# through AttentionInterface, positions by position_ids, no sliding window.
NATIVE = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3"})
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Loaded:
    """What loading a folder gives: the library's model and the facts the runtime needs."""

    model: Any
    tokenizer: Any
    eos_ids: tuple[int, ...]
    context_tokens: int
    native: bool
    why_not_native: str


def native_problem(config: Any) -> str:
    """Why this architecture cannot be stepped natively ("" when it can)."""
    kind = getattr(config, "model_type", "")
    if kind not in NATIVE:
        return f"model_type {kind!r} is not stepped natively (stepped: {', '.join(sorted(NATIVE))})"
    window = getattr(config, "sliding_window", None)
    context = context_of(config)
    if window is not None and getattr(config, "use_sliding_window", True) and window < context:
        return f"a sliding window of {window} tokens (shorter than the context of {context})"
    return ""


def context_of(config: Any) -> int:
    return int(getattr(config, "max_position_embeddings", None) or config.n_positions)


def eos_ids(folder: Path, config: Any) -> tuple[int, ...]:
    """The tokens that end a sequence: generation_config.json's, else config.json's."""
    found: Any = None
    path = folder / "generation_config.json"
    if path.exists():
        found = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if found is None:
        found = getattr(config, "eos_token_id", None)
    if found is None:
        return ()
    return tuple(found) if isinstance(found, list) else (int(found),)


def load(
    folder: Path,
    device: str,
    precision: str,
    native: str = "auto",
    tokenizer_file: Path | None = None,
) -> Loaded:
    """The folder's model on ``device`` in ``precision``; ``native``: auto, or never.

    ``tokenizer_file``: the model's ``input.tokenizer`` (default: the folder's
    tokenizer.json), the one the API counts prompts with, so the text a job's
    tokens make is decoded by the same tokenizer that encoded its prompt.
    """
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    why = native_problem(config) if native == "auto" else "parameters.native is never"
    kwargs: dict[str, Any] = {"dtype": DTYPES[precision]}
    if not why:
        paged.register()
        kwargs["attn_implementation"] = paged.ATTENTION
    model: Any = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model = model.to(device).eval()
    tokenizer = Tokenizer.from_file(str(tokenizer_file or folder / "tokenizer.json"))
    return Loaded(
        model=model,
        tokenizer=tokenizer,
        eos_ids=eos_ids(folder, config),
        context_tokens=context_of(config),
        native=not why,
        why_not_native=why,
    )


def kv_blocks(
    model: Any,
    device: str,
    dtype: torch.dtype,
    block_size: int,
    budget_bytes: float,
    step_tokens: int,
) -> tuple[int, int]:
    """``(blocks, bytes_per_block)`` the budget leaves for the KV pool on ``device``.

    On a GPU, the model's bytes are what is allocated now, and a step's
    activations are measured by running one step of ``step_tokens`` tokens
    in a pool just big enough for it; on the CPU nothing is measured: the
    budget is the KV pool's alone.
    """
    shape = paged.KVShape.of(model.config, dtype)
    per_block = shape.bytes_per_token * block_size
    if not device.startswith("cuda"):
        return max(0, int(budget_bytes // per_block)), per_block
    cuda = torch.cuda
    cuda.synchronize(device)
    model_bytes = cuda.memory_allocated(device)
    trial_blocks = -(-step_tokens // block_size)
    cuda.reset_peak_memory_stats(device)
    before = cuda.memory_allocated(device)
    pool = paged.KVPool(shape, trial_blocks, block_size, device)
    measured_block = (cuda.memory_allocated(device) - before) / trial_blocks
    table = torch.arange(trial_blocks, device=device)
    slots = pool.slots(table, step_tokens)
    layout = paged.StepLayout(pool, (paged.Segment(0, step_tokens, 0, slots),), slots)
    ids = torch.zeros((1, step_tokens), dtype=torch.long, device=device)
    positions = torch.arange(step_tokens, device=device)[None]
    with torch.inference_mode():
        model(
            input_ids=ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=1,
            **{paged.STEP_KWARG: layout},
        )
    cuda.synchronize(device)
    step_bytes = cuda.max_memory_allocated(device) - model_bytes - pool.bytes
    del pool, layout, slots
    cuda.empty_cache()
    per_block = max(per_block, int(measured_block))
    blocks = int((budget_bytes - model_bytes - step_bytes) // per_block)
    log.info(
        "KV pool sized",
        extra={
            "model_bytes": model_bytes,
            "step_bytes": step_bytes,
            "bytes_per_block": per_block,
            "blocks": blocks,
        },
    )
    return max(0, blocks), per_block
