"""The shipped model repository's models, for tests: configs and loaded runtimes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from backends import get_backend
from backends.base import Runtime, RuntimeOptions
from core.config.settings import PER_MODEL, Settings
from core.models.reader import load_repository
from core.models.repository import ModelConfig

# The shipped one, or a copy FERRY_MODEL_REPOSITORY names (the GPU check's, in fp16).
REPOSITORY = Path(
    os.environ.get("FERRY_MODEL_REPOSITORY") or Path(__file__).resolve().parents[1] / "models"
)


def shipped(name: str, **overrides: Any) -> ModelConfig:
    """``name`` as the shipped repository has it, [input]/[parameters] values replaced.

    The environment is not read: a test's model is what the test says.
    """
    repository = load_repository(
        REPOSITORY, environ={}, known_settings=PER_MODEL, overrides={name: overrides}
    )
    assert not repository.problems, repository.problems
    return repository[name]


def runtime(
    name: str,
    device: str = "cpu",
    load: bool = True,
    overrides: dict[str, Any] | None = None,
    **options: Any,
) -> Runtime:
    """A runtime of the shipped ``name`` on ``device``; ``options``: RuntimeOptions' fields."""
    model = shipped(name, **(overrides or {}))
    built = get_backend(model.backend).runtime(
        model, model.version(), RuntimeOptions(device=device, **options)
    )
    if load:
        built.load()
    return built


def minilm_files() -> Path:
    """The folder of the shipped minilm's weights and tokenizer."""
    return shipped("minilm").version().files


def with_parameters(settings: Settings, model: str, **values: Any) -> Settings:
    """``settings`` with these [input]/[parameters] values of ``model`` replaced as well."""
    merged = dict(settings.model_parameters)
    merged[model] = {**merged.get(model, {}), **values}
    return settings.model_copy(update={"model_parameters": merged})
