"""The ``sentence-transformers`` backend: a saved SentenceTransformer folder, embeddings out.

The version's files are what ``SentenceTransformer.save`` writes:
``modules.json`` naming a Transformer (a ``transformers`` encoder with its
``tokenizer.json``), a Pooling module (mean, CLS or max) and optionally
Normalize. The backend computes what sentence-transformers computes without
importing it: tokenise (truncating at ``input.max_tokens``), run the encoder,
pool over the attention mask, L2-normalise when the folder says so. On a
CUDA device all work runs on the model's own stream, synchronised by an event
on that stream, with inputs and outputs staged in pinned host buffers reused
from batch to batch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.base import RuntimeOptions, autocast, file_problems, parameter_problems
from backends.torch_runtime import PinnedStager, TorchRuntime, calibrate_text, staged
from core.models.repository import ModelConfig, ModelVersion, Problem

TRANSFORMER = "sentence_transformers.models.Transformer"
POOLING = "sentence_transformers.models.Pooling"
NORMALIZE = "sentence_transformers.models.Normalize"
POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
}

# Activations per padded token, a deliberate over-estimate (hidden states,
# attention scores for 12 heads, the feed-forward layer, in fp32) used where
# peak memory cannot be measured.
DECLARED_BYTES_PER_TOKEN = 64 * 1024


@dataclass(frozen=True)
class Layout:
    """What a SentenceTransformer folder's modules.json says: where the encoder is, how to pool."""

    transformer: Path
    pooling: str  # mean | cls | max
    normalize: bool
    max_seq_length: int | None


def read_layout(files: Path) -> Layout:
    """The folder's layout; ValueError (naming the file) when it is not one this backend runs."""
    modules_file = files / "modules.json"
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{modules_file.name} cannot be read ({exc})") from None
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file.name} must be a list of modules")
    transformer = pooling = None
    normalize = False
    for module in modules:
        kind = module.get("type") if isinstance(module, dict) else None
        path = files / str(module.get("path", "")) if isinstance(module, dict) else files
        if kind == TRANSFORMER and transformer is None:
            transformer = path
        elif kind == POOLING and pooling is None:
            pooling = path
        elif kind == NORMALIZE:
            normalize = True
        else:
            raise ValueError(
                f"{modules_file.name}: module {kind!r} is not supported (a Transformer, then "
                "Pooling, then optionally Normalize)"
            )
    if transformer is None or pooling is None:
        raise ValueError(f"{modules_file.name} must name a Transformer and a Pooling module")
    try:
        config = json.loads((pooling / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the pooling module's config.json cannot be read ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError("the pooling module's config.json must be a JSON object")
    modes = [mode for key, mode in POOLING_MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise ValueError("the pooling module's config.json must choose one of mean, cls or max")
    max_seq_length = None
    bert_config = transformer / "sentence_bert_config.json"
    if bert_config.is_file():
        try:
            max_seq_length = json.loads(bert_config.read_text()).get("max_seq_length")
        except (OSError, ValueError, AttributeError) as exc:
            raise ValueError(f"sentence_bert_config.json cannot be read ({exc})") from None
        if max_seq_length is not None and not isinstance(max_seq_length, int):
            raise ValueError("sentence_bert_config.json: max_seq_length must be an integer")
    return Layout(transformer, modes[0], normalize, max_seq_length)


class SentenceTransformersBackend:
    name = "sentence-transformers"
    input_kinds = frozenset({"text"})
    uses_device = True

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        problems = parameter_problems(model, {})
        problems += file_problems(model, version, "modules.json")
        if problems:
            return problems
        try:
            layout = read_layout(version.files)
        except ValueError as exc:
            return [Problem(model.where(version.folder), "", str(exc))]
        missing = [
            name
            for name in ("config.json", "tokenizer.json")
            if not (layout.transformer / name).is_file()
        ]
        weights = ("model.safetensors", "pytorch_model.bin")
        if not any((layout.transformer / name).is_file() for name in weights):
            missing.append(" or ".join(weights))
        return [
            Problem(model.where(version.folder), "", f"{name} is missing from the encoder's folder")
            for name in missing
        ]

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> SentenceTransformerRuntime:
        layout = read_layout(version.files)
        max_tokens = model.input.max_tokens or layout.max_seq_length or 512
        return SentenceTransformerRuntime(model.name, layout, max_tokens, options)


BACKENDS = {"sentence-transformers": SentenceTransformersBackend()}


class SentenceTransformerRuntime(TorchRuntime):
    padded = True  # every text in a batch is padded to the longest

    def __init__(self, name: str, layout: Layout, max_tokens: int, options: RuntimeOptions) -> None:
        super().__init__(options)
        self.name = name
        self.layout = layout
        self.max_tokens = max_tokens
        self._tokenizer: Any = None

    def load(self) -> None:
        # The weights are on disk; never let a library reach for a hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import transformers
        from tokenizers import Tokenizer
        from transformers import AutoModel

        model_dir = self.layout.transformer
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
        return calibrate_text(self, " ".join(["word"] * (self.max_tokens - 2)))

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
        if self.layout.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.layout.pooling == "max":
            pooled = hidden.masked_fill(weights == 0, -1e9).max(dim=1).values
        else:
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        if not self.layout.normalize:
            return pooled
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def _outputs(self, result: Any) -> list[Any]:
        return list(result.tolist())
