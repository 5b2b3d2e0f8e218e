"""Bodies of the generation routes: OpenAI's completions and chat completions, and
the answer to cancelling a running generation.

The request models are what the OpenAPI document shows and what FastAPI
checks types against; they keep fields they do not name (``extra="allow"``)
so that ``api.openai.generation`` can refuse each of OpenAI's parameters
Ferry does not honour by its name, instead of a generic "unknown field".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from scheduler.vocabulary import Lane


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = Field(
        default=None, description="Send a chunk with the usage (and no choices) before [DONE]."
    )


class GenerationBody(BaseModel):
    """What both routes take: sampling, streaming, and Ferry's own fields."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=64, description="A generation model's name.")
    max_tokens: int | None = Field(default=None, description="Tokens to generate at most.")
    temperature: float | None = Field(default=None, description="0 to 2; 0 is greedy.")
    top_p: float | None = Field(default=None, description="Above 0, at most 1.")
    stop: str | list[str] | None = Field(default=None, description="Up to 4 stop strings.")
    seed: int | None = Field(default=None, description="Makes sampling repeatable.")
    presence_penalty: float | None = Field(
        default=None, description="-2 to 2: taken off a token's logit once it has come."
    )
    frequency_penalty: float | None = Field(
        default=None, description="-2 to 2: taken off a token's logit each time it has come."
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token ids (as strings) and -100 to 100 added to their logits."
    )
    n: int | None = Field(default=None, description="Only 1.")
    user: str | None = Field(default=None, description="Kept in the job's metadata.")
    stream: bool | None = Field(default=None, description="Answer with Server-Sent Events.")
    stream_options: StreamOptions | None = None
    priority: Lane | None = Field(
        default=None, description="Ferry's: the job's lane (or the X-Ferry-Priority header)."
    )
    deadline_ms: int | None = Field(
        default=None, description="Ferry's: the job expires if it cannot start in time."
    )
    ferry_cancel_on_disconnect: bool | None = Field(
        default=None,
        description="Ferry's, with stream: cancel the job when the client disconnects "
        "(by default it runs to the end, and its result stays readable).",
    )


class CompletionRequest(GenerationBody):
    """OpenAI's completions request."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="The text to continue, or its token ids (nothing added to them); or a "
        "list of either, each prompt a choice (n of each)."
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    # Optional here so that a missing one is refused by the generation check, which
    # names it as every other refusal does (messages[2].role).
    role: str | None = Field(default=None, description="system (or developer), user or assistant.")
    content: str | list[dict[str, Any]] | None = Field(
        default=None, description="Text, or text parts."
    )


class ChatCompletionRequest(GenerationBody):
    """OpenAI's chat completions request."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(
        default=None, description="OpenAI's newer name for max_tokens."
    )


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = Field(description="stop, length, or cancelled.")


class TextCompletion(BaseModel):
    id: str = Field(description="cmpl- and the job's id.")
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = Field(description="stop, length, or cancelled.")


class ChatCompletion(BaseModel):
    id: str = Field(description="chatcmpl- and the job's id.")
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None
