"""The model repository: one folder per model, a ``model.toml`` and one folder per version.

The shape NVIDIA Triton's users know::

    models/
      minilm/
        model.toml        # name, backend, input, cost, batching, memory, instances, parameters
        1/                # version 1's files (or a version.toml saying where they are)
        2/

This module reads and checks a repository without importing any backend or
torch: the API builds its input checks from it, ``ferry models check`` reports
its problems, and the workers find their model's files in it. Every problem
names the file and the field it is about. The format is documented field by
field in docs/model-repository.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Problem:
    """Something wrong with a repository: the file, the field (dotted), and why."""

    file: str
    field: str
    message: str
    # A warning does not stop Ferry from serving (files a model not served lacks).
    warning: bool = False

    def __str__(self) -> str:
        where = f"{self.file}: {self.field}" if self.field else self.file
        return f"{where}: {self.message}"


class RepositoryError(Exception):
    """A repository Ferry cannot serve; ``problems`` says every reason found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


@dataclass(frozen=True)
class TensorSpec:
    """One named input tensor of a ``tensor`` model: its shape per item (no batch axis)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class EmbeddingsConfig:
    """``[embeddings]``: the model's outputs are vectors, served on ``POST /v1/embeddings``.

    ``dimensions``: the length of every vector. ``truncatable``: a client may ask
    for fewer (OpenAI's ``dimensions``): the first N, L2-normalised again, as
    for models trained to keep their meaning in their leading dimensions.
    """

    dimensions: int
    truncatable: bool = False


@dataclass(frozen=True)
class InputConfig:
    """``[input]``: what one job's input is, and the limits it is checked against."""

    kind: str
    # text
    max_chars: int = 20_000
    max_tokens: int | None = None
    overlength: str = "truncate"  # truncate | refuse
    tokenizer: str | None = None  # a tokenizer.json, relative to the version's files
    # image
    image_size: int = 224
    max_image_bytes: int = 700 * 1024
    max_pixels: int = 40_000_000
    # json: a JSON Schema the input must satisfy
    schema: Mapping[str, Any] | None = None
    # tensor
    tensors: tuple[TensorSpec, ...] = ()
    # generation (with max_chars and tokenizer): a prompt or chat messages, continued
    context_tokens: int | None = None  # None: the version's config.json says
    default_max_tokens: int = 256
    chat_template: str | None = None  # None: tokenizer_config.json's, when it has one


@dataclass(frozen=True)
class CostConfig:
    """``[cost]``: what one job costs the scheduler (its budget is in these units)."""

    function: str  # tokens | pixels | field | constant
    field: str | None = None  # function "field": the input's member holding the cost
    max: int | None = None  # function "field": the largest cost accepted
    value: int = 1  # function "constant"


@dataclass(frozen=True)
class ModelVersion:
    """One version folder: its number, and where its files are."""

    number: int
    folder: Path
    files: Path


@dataclass(frozen=True)
class ModelConfig:
    """One model of the repository, as its ``model.toml`` says, overrides applied."""

    name: str
    backend: str
    folder: Path
    description: str
    input: InputConfig
    cost: CostConfig
    versions: Mapping[int, ModelVersion]
    active_version: int
    precision: str | None = None
    # Per-model scheduler settings by their core.config.settings names ([batching], [memory]).
    settings: Mapping[str, Any] = field(default_factory=dict)
    device: str = "auto"  # auto | gpu | cpu | none
    count: int = 1  # workers per GPU, or in all without GPUs
    parameters: Mapping[str, Any] = field(default_factory=dict)
    embeddings: EmbeddingsConfig | None = None

    @property
    def config_file(self) -> Path:
        return self.folder / "model.toml"

    def where(self, path: Path | None = None) -> str:
        """``path`` (default: model.toml) as problems name it: from the repository's folder."""
        return relative(self.folder.parent, path or self.config_file)

    def concerns(self, problem: Problem) -> bool:
        """Whether ``problem`` is about one of this model's files."""
        label = self.where(self.folder)
        return problem.file == label or problem.file.startswith(label + "/")

    def version(self, number: int | None = None) -> ModelVersion:
        """``number``'s version (None: the active one); KeyError when there is none."""
        return self.versions[self.active_version if number is None else number]

    def tokenizer_path(self, number: int | None = None) -> Path | None:
        if self.input.tokenizer is None:
            return None
        return self.version(number).files / self.input.tokenizer

    def parameter_path(self, key: str, number: int | None = None) -> Path | None:
        """A path parameter: absolute as given, or relative to the version's files."""
        value = self.parameters.get(key)
        if not value:
            return None
        path = Path(str(value)).expanduser()
        return path if path.is_absolute() else self.version(number).files / path


@dataclass(frozen=True)
class Repository:
    root: Path
    models: Mapping[str, ModelConfig]
    problems: tuple[Problem, ...] = ()

    def __getitem__(self, name: str) -> ModelConfig:
        return self.models[name]

    def __contains__(self, name: object) -> bool:
        return name in self.models

    def __iter__(self) -> Any:
        return iter(self.models)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if not p.warning]


def env_name(model: str, key: str) -> str:
    """The environment variable that overrides ``key`` of ``model``'s [input] or [parameters]."""
    return "FERRY_" + re.sub(r"[^A-Za-z0-9]", "_", f"{model}_{key}").upper()


def relative(root: Path, path: Path) -> str:
    """``path`` as problems name it: from the folder holding the repository."""
    try:
        return str(path.relative_to(root.parent)) if root.parent != path else str(path)
    except ValueError:
        return str(path)
