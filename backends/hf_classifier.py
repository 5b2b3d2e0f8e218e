"""The ``hf-classifier`` backend: a saved ``transformers`` sequence classifier, labels out.

The version's files are what ``save_pretrained`` writes for an
``AutoModelForSequenceClassification`` (``config.json`` naming a
``...ForSequenceClassification`` architecture and its ``id2label``, the
weights) beside the tokenizer's ``tokenizer.json``. Texts are tokenised with
the ``tokenizers`` library, truncated at ``input.max_tokens`` (else at the
model's own position limit) and padded to the longest in the batch.

Each output is the top ``top_k`` labels (parameter, default 5, or every label
when there are fewer), best first, and the best one alone::

    {"label": "positive", "score": 0.93,
     "scores": [{"label": "positive", "score": 0.93}, {"label": "negative", "score": 0.07}]}

Scores are what transformers' text-classification pipeline gives by default:
a softmax over the labels, a sigmoid per label when ``problem_type`` is
``multi_label_classification`` (or there is a single label), the raw logits
for ``regression``.
"""

from __future__ import annotations

import json
import os
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from backends.base import RuntimeOptions, autocast, file_problems, parameter_problems
from backends.torch_runtime import PinnedStager, TorchRuntime, calibrate_text, staged
from core.models.repository import ModelConfig, ModelVersion, Problem

PARAMETERS: dict[str, type | tuple[type, ...]] = {"top_k": int}
DEFAULT_TOP_K = 5
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Models whose position ids start after the padding id (RoBERTa's scheme):
# ``max_position_embeddings - pad_token_id - 1`` tokens fit, not all of them.
OFFSET_POSITIONS = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "longformer"}
)
# A tokenizer_config.json without a real limit says so with a huge number.
NO_LIMIT = 1_000_000
# Used where config.json lacks the sizes that size the per-token estimate.
FALLBACK_BYTES_PER_TOKEN = 64 * 1024


@dataclass(frozen=True)
class ClassifierConfig:
    """What config.json says that the backend needs, read without transformers."""

    labels: tuple[str, ...]  # by class index
    scoring: str  # softmax | sigmoid | none
    position_limit: int | None  # the most tokens the model can take
    pad_id: int
    bytes_per_token: int


def read_config(files: Path) -> ClassifierConfig:
    """The folder's classifier config; ValueError (naming the field) when it is not one."""
    path = files / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError("", f"cannot be read ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError("", "must be a JSON object")
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not any(
        isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures
    ):
        raise ConfigError(
            "architectures",
            f"is {architectures!r}; the model must be saved from a ...ForSequenceClassification "
            "(AutoModelForSequenceClassification) model",
        )
    id2label = config.get("id2label")
    if not isinstance(id2label, dict) or not id2label:
        raise ConfigError("id2label", "must name every label by its class index")
    try:
        by_index = {int(key): str(label) for key, label in id2label.items()}
    except ValueError:
        raise ConfigError("id2label", "must be keyed by class index (0, 1, ...)") from None
    if sorted(by_index) != list(range(len(by_index))):
        raise ConfigError("id2label", f"must name classes 0 to {len(by_index) - 1}, each once")
    labels = tuple(by_index[i] for i in range(len(by_index)))
    problem_type = config.get("problem_type")
    if problem_type == "regression":
        scoring = "none"
    elif problem_type == "multi_label_classification" or len(labels) == 1:
        scoring = "sigmoid"
    else:
        scoring = "softmax"
    pad_id = config.get("pad_token_id")
    pad_id = pad_id if isinstance(pad_id, int) and not isinstance(pad_id, bool) else 0
    return ClassifierConfig(
        labels, scoring, position_limit(config, files, pad_id), pad_id, bytes_per_token(config)
    )


class ConfigError(ValueError):
    """config.json is not a sequence classifier's; ``field`` says where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def position_limit(config: dict[str, Any], files: Path, pad_id: int) -> int | None:
    """The most tokens (special ones included) the model has positions for, if it says."""
    limits = []
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool):
        if config.get("model_type") in OFFSET_POSITIONS:
            positions -= pad_id + 1
        limits.append(positions)
    try:
        tokenizer_config = json.loads((files / "tokenizer_config.json").read_text("utf-8"))
        length = tokenizer_config.get("model_max_length")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        length = None
    if isinstance(length, int) and not isinstance(length, bool) and 0 < length < NO_LIMIT:
        limits.append(length)
    return min(limits) if limits else None


def bytes_per_token(config: dict[str, Any]) -> int:
    """A deliberate over-estimate of a padded token's activations, in fp32.

    Per token and layer in flight: a few copies of the hidden state, the
    feed-forward layer's, and a row of attention scores per head (as long as
    the longest batch, taken here as the position limit).
    """
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings")
    sizes = [config.get(key) for key in keys]
    numbers = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    if len(numbers) != len(keys):
        return FALLBACK_BYTES_PER_TOKEN
    hidden, intermediate, heads, positions = numbers
    return 2 * 4 * (6 * hidden + 2 * intermediate + heads * positions)


def tokenizer_file(model: ModelConfig, version: ModelVersion) -> Path:
    """The tokenizer the API prices inputs with, so the model sees the same tokens."""
    return version.files / (model.input.tokenizer or "tokenizer.json")


class HFClassifierBackend:
    name = "hf-classifier"
    input_kinds = frozenset({"text"})
    uses_device = True

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        problems = parameter_problems(model, PARAMETERS)
        top_k = model.parameters.get("top_k")
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < 1:
            problems.append(Problem(model.where(), "parameters.top_k", "must be at least 1"))
        if model.input.kind != "text":
            problems.append(Problem(model.where(), "input.kind", f"{self.name} takes text inputs"))
        problems += file_problems(model, version, "config.json")
        if not any((version.files / name).is_file() for name in WEIGHTS):
            problems.append(
                Problem(
                    model.where(version.folder),
                    "",
                    f"the weights are missing ({' or '.join(WEIGHTS[::2])}; looked in "
                    f"{version.files})",
                )
            )
        tokenizer = tokenizer_file(model, version)
        if not tokenizer.is_file():
            field = "input.tokenizer" if model.input.tokenizer else ""
            where = model.where() if field else model.where(version.folder)
            problems.append(
                Problem(where, field, f"{tokenizer.name} is missing (looked in {version.files})")
            )
        if not (version.files / "config.json").is_file():
            return problems
        try:
            config = read_config(version.files)
        except ConfigError as exc:
            where = model.where(version.files / "config.json")
            return [*problems, Problem(where, exc.field, exc.message)]
        limit = config.position_limit
        if limit is not None and model.input.max_tokens and model.input.max_tokens > limit:
            problems.append(
                Problem(
                    model.where(),
                    "input.max_tokens",
                    f"is {model.input.max_tokens}, but the model takes at most {limit} tokens",
                )
            )
        return problems

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> HFClassifierRuntime:
        config = read_config(version.files)
        max_tokens = model.input.max_tokens or config.position_limit or 512
        if config.position_limit is not None:
            max_tokens = min(max_tokens, config.position_limit)
        top_k = int(model.parameters.get("top_k", DEFAULT_TOP_K))
        return HFClassifierRuntime(
            model.name,
            version.files,
            tokenizer_file(model, version),
            config,
            max_tokens,
            top_k,
            options,
        )


BACKENDS = {"hf-classifier": HFClassifierBackend()}


@dataclass(eq=False)
class HFClassifierRuntime(TorchRuntime):
    padded = True  # every text in a batch is padded to the longest

    name: str
    files: Path
    tokenizer_path: Path
    config: ClassifierConfig
    max_tokens: int
    top_k: int
    options: InitVar[RuntimeOptions]

    def __post_init__(self, options: RuntimeOptions) -> None:
        super().__init__(options)
        self.top_k = min(self.top_k, len(self.config.labels))
        self._tokenizer: Any = None
        self._token_types = False  # whether the model's forward takes token_type_ids

    def load(self) -> None:
        # The weights are on disk; never let a library reach for a hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import inspect

        import transformers
        from tokenizers import Tokenizer
        from transformers import AutoModelForSequenceClassification

        tokenizer = Tokenizer.from_file(str(self.tokenizer_path))
        tokenizer.enable_truncation(max_length=self.max_tokens)
        # The model's own padding id: RoBERTa-like models derive positions from it.
        pad_token = tokenizer.id_to_token(self.config.pad_id) or "[PAD]"
        tokenizer.enable_padding(pad_id=self.config.pad_id, pad_token=pad_token)
        self._tokenizer = tokenizer
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self._take_device()
        model = AutoModelForSequenceClassification.from_pretrained(
            str(self.files), local_files_only=True
        )
        # Some encoders (DistilBERT) have no segment embeddings and refuse the argument.
        self._token_types = "token_type_ids" in inspect.signature(model.forward).parameters
        # fp32 whatever the file holds; the precision setting decides the arithmetic.
        self._model = model.float().to(self.device).eval()
        self._weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._warm_up("warm-up", " ".join(["word"] * self.max_tokens))  # the longest input

    def declared_memory(self) -> tuple[float, float]:
        return float(self._weights_bytes), float(self.config.bytes_per_token)

    def calibrate(self) -> tuple[float, float, float] | None:
        """Time a small and a large batch, so the first estimates are measured, not guessed."""
        return calibrate_text(self, " ".join(["word"] * self.max_tokens))

    def _host_inputs(self, inputs: list[Any], stager: PinnedStager | None) -> list[Any]:
        import torch

        encodings = self._tokenizer.encode_batch([str(text) for text in inputs])
        names = (
            ("ids", "attention_mask", "type_ids")
            if self._token_types
            else ("ids", "attention_mask")
        )
        return [
            staged(stager, name, torch.tensor([getattr(e, name) for e in encodings]))
            for name in names
        ]

    def _forward(self, ids: Any, mask: Any, types: Any = None) -> Any:
        import torch

        arguments = {"input_ids": ids, "attention_mask": mask}
        if types is not None:
            arguments["token_type_ids"] = types
        with autocast(self.device, self.precision):
            logits = self._model(**arguments).logits
        logits = logits.float()  # scores in fp32 whatever the precision
        if self.config.scoring == "softmax":
            return torch.softmax(logits, dim=-1)
        if self.config.scoring == "sigmoid":
            return torch.sigmoid(logits)
        return logits

    def _outputs(self, result: Any) -> list[Any]:
        import torch

        scores, order = torch.sort(result, dim=-1, descending=True, stable=True)
        labels = self.config.labels
        outputs = []
        for row_scores, row_order in zip(
            scores[:, : self.top_k].tolist(), order[:, : self.top_k].tolist(), strict=True
        ):
            top = [
                {"label": labels[index], "score": score}
                for index, score in zip(row_order, row_scores, strict=True)
            ]
            outputs.append({"label": top[0]["label"], "score": top[0]["score"], "scores": top})
        return outputs
