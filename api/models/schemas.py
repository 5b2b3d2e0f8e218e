"""Response bodies of /v1/models: OpenAI's model objects with Ferry's own fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class VersionInfo(BaseModel):
    version: int
    active: bool = Field(description="New jobs run on this version.")
    state: str = Field(
        description="What the model's live workers do with it: loading, ready (serving), "
        "draining (its last batches finish), failed (could not load: see reason), or "
        "available (in the repository; no worker holds it)."
    )
    reason: str | None = Field(default=None, description="Why it failed to load.")
    workers: int = Field(default=0, description="Live workers in that state.")


class GenerationInfo(BaseModel):
    context_tokens: int = Field(description="The prompt and max_tokens together, at most.")
    default_max_tokens: int = Field(
        description="max_tokens when a job gives none (capped to what the context leaves)."
    )
    chat: bool = Field(description="Takes messages (it has a chat template), not only prompt.")
    execution: Literal["step", "generate"] | None = Field(
        default=None,
        description="How its workers run it: step for models whose architecture Ferry steps "
        "natively, generate for others run through the library's generate(); null until a "
        "worker says.",
    )
    why: str | None = Field(
        default=None, description="With execution generate: why it is not stepped natively."
    )
    prefix_caching: bool | None = Field(
        default=None,
        description="Whether prompts that begin alike share their prefix's KV blocks, "
        "computed once (null until a worker says).",
    )
    step_fixed_ms: float | None = Field(
        default=None,
        description="Learned: a step's time = fixed + per_token x its tokens (null until a "
        "worker says).",
    )
    step_per_token_ms: float | None = Field(
        default=None, description="Learned: a step's time per token it computes."
    )


class ModelInfo(BaseModel):
    """A model in OpenAI's shape (id, object, created, owned_by), and Ferry's own fields."""

    id: str = Field(description="The model's name, as OpenAI's clients read it.")
    object: Literal["model"] = "model"
    created: int = Field(
        description="Unix seconds: when its active version was activated, else when its "
        "model.toml last changed."
    )
    owned_by: str = "ferry"
    name: str
    kind: str = Field(description="Its input kind: text, image, json, tensor or generation.")
    generation: GenerationInfo | None = Field(
        default=None, description="For generation models: the context and what they take."
    )
    backend: str
    version: int = Field(description="The active version: the one jobs run on by default.")
    versions: list[VersionInfo]
    description: str
    input_schema: dict[str, Any]
    max_batch_size: int
    queue_depth: dict[str, int]
    workers: int
    avg_batch_ms: float | None
    avg_batch_size: float | None
    latency_fixed_ms: float | None = Field(
        description="Learned: latency = fixed + per_work x work."
    )
    latency_per_work_ms: float | None = Field(
        description="Learned: per unit of work (padded tokens for minilm, summed cost for sim)."
    )
    window_ms: float | None = Field(description="The adaptive window now.")
    batch_efficiency: float | None = Field(
        description="Recent average of sum cost / (n x max cost) per batch."
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfo]
