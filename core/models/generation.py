"""The ``generation`` input kind: a prompt (or chat messages) and how to continue it.

The API checks a job's input here before anything is stored, without torch:
the members and their ranges, the chat template rendered into the prompt,
the prompt's tokens counted with the model's tokenizer.json, and that the
prompt and ``max_tokens`` fit in the model's context. What it stores, and
what the worker gets, is the normalised input :meth:`GenerationSpec.validate`
returns; its cost is the prompt's tokens plus ``max_tokens``, the KV cache the
job reserves. :func:`prompt_token_ids` turns that input into token ids for
both, so the count priced here is the count the worker runs.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from core.models.chat import (
    TOKENIZER_CONFIG,
    ChatTemplate,
    ChatTemplateError,
    TemplateRefused,
    load_template,
    template_source,
)
from core.models.inputs import InputError, Validated, json_type, load_tokenizer
from core.models.repository import InputConfig, ModelConfig

ROLES = ("system", "user", "assistant")
MEMBERS = (
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "prompt_logprobs",
)
PENALTIES = ("presence_penalty", "frequency_penalty")
MAX_LOGPROBS = 20
PENALTY_LIMIT = 2.0
BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS = 300
MESSAGE_MEMBERS = ("role", "content")
MAX_STOPS = 4
SEED_LIMIT = 2**63
# config.json's names for the longest sequence a model takes (GPT-2's is n_positions).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions")


def prompt_token_ids(value: Mapping[str, Any], tokenizer: Path) -> list[int]:
    """The token ids of a validated input's prompt: what the API counts and the worker runs.

    One rule, kept here only so that the two never disagree: a prompt given
    as text gets the special tokens the tokenizer's post-processor adds
    (Llama's BOS; none for GPT-2); a prompt rendered from ``messages`` gets
    none added, because the chat template writes its own (transformers'
    ``apply_chat_template`` encodes it the same way); a prompt given as token
    ids is those ids, nothing added.
    """
    if "prompt_ids" in value:  # given as token ids: taken as they are
        return [int(id) for id in value["prompt_ids"]]
    add_special_tokens = "messages" not in value
    encoded = load_tokenizer(tokenizer).encode(
        value["prompt"], add_special_tokens=add_special_tokens
    )
    return list(encoded.ids)


def config_context_tokens(files: Path) -> int:
    """The context length in a version's config.json; ValueError saying why it has none."""
    path = files / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path.name} cannot be read ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path.name} is not valid JSON ({exc})") from None
    for key in CONTEXT_KEYS:
        found = config.get(key) if isinstance(config, dict) else None
        if isinstance(found, int) and not isinstance(found, bool) and found >= 2:
            return found
    raise ValueError(f"{path.name} has no max_position_embeddings (or n_positions)")


def chat_template_path(config: InputConfig, files: Path) -> Path | None:
    """The file a version's chat template is in: the one named, else tokenizer_config.json's.

    None: no file was named and tokenizer_config.json holds no template (or
    is not there); the model then takes prompts only.
    """
    if config.chat_template is not None:
        return files / config.chat_template
    default = files / TOKENIZER_CONFIG
    if not default.is_file():
        return None
    try:
        return default if template_source(default) is not None else None
    except ValueError:
        return default  # a broken member is reported when the template is loaded


@dataclass(frozen=True)
class GenerationSpec:
    """A prompt or messages, sampling parameters, checked against one version's context."""

    kind: ClassVar[str] = "generation"

    name: str
    max_chars: int
    tokenizer: Path
    context_tokens: int
    default_max_tokens: int
    chat: ChatTemplate | None

    @property
    def input_schema(self) -> dict[str, Any]:
        text = {"type": "string", "minLength": 1}
        properties: dict[str, Any] = {
            "prompt": {
                "anyOf": [
                    {**text, "maxLength": self.max_chars},
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": self.context_tokens - 1,
                        "items": {"type": "integer", "minimum": 0},
                    },
                ],
                "description": "The text to continue, or its token ids (taken as they are: "
                "no special token added).",
            }
        }
        if self.chat is not None:
            message = {
                "type": "object",
                "properties": {"role": {"enum": list(ROLES)}, "content": text},
                "required": list(MESSAGE_MEMBERS),
                "additionalProperties": False,
            }
            properties["messages"] = {
                "type": "array",
                "minItems": 1,
                "items": message,
                "description": "A conversation, rendered by the model's chat template.",
            }
        properties |= {
            "max_tokens": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": self.context_tokens - 1,
                "description": f"Tokens to generate at most (default {self.default_max_tokens}, "
                "or what the context leaves).",
            },
            "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2, "default": 1},
            "top_p": {
                "type": ["number", "null"],
                "exclusiveMinimum": 0,
                "maximum": 1,
                "default": 1,
            },
            "stop": {
                "anyOf": [
                    text,
                    {"type": "array", "maxItems": MAX_STOPS, "items": text},
                    {"type": "null"},
                ]
            },
            "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": SEED_LIMIT - 1},
            **{
                name: {
                    "type": ["number", "null"],
                    "minimum": -PENALTY_LIMIT,
                    "maximum": PENALTY_LIMIT,
                    "default": 0,
                    "description": f"Subtracted from a generated token's logit {what}.",
                }
                for name, what in zip(
                    PENALTIES, ("once it has come", "each time it has come"), strict=True
                )
            },
            "logprobs": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": MAX_LOGPROBS,
                "description": "Each generated token's log probability in the output, with "
                "this many of the likeliest tokens at its place.",
            },
            "prompt_logprobs": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": MAX_LOGPROBS,
                "description": "Each prompt token's log probability given the tokens before "
                "it in the output (the first has none), with this many of the likeliest "
                "tokens at its place: a prompt scored.",
            },
            "logit_bias": {
                "type": ["object", "null"],
                "maxProperties": MAX_LOGIT_BIAS,
                "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
                "additionalProperties": {
                    "type": "number",
                    "minimum": -BIAS_LIMIT,
                    "maximum": BIAS_LIMIT,
                },
                "description": "Token ids (as strings) and the number added to their logits.",
            },
        }
        required = [["prompt"], ["messages"]] if self.chat is not None else [["prompt"]]
        return {
            "type": "object",
            "properties": properties,
            "oneOf": [{"required": r} for r in required],
            "additionalProperties": False,
            "description": f"A prompt and at most {self.context_tokens} tokens of context "
            "(prompt and max_tokens together).",
        }

    def validate(self, value: Any) -> Validated:
        if not isinstance(value, dict):
            raise InputError(
                "input", f"must be an object with prompt or messages, got {json_type(value)}"
            )
        for member in value:
            if member not in MEMBERS:
                raise InputError(
                    str(member), f"is not a field of generation inputs ({', '.join(MEMBERS)})"
                )
        normalised: dict[str, Any] = self._prompt(value)
        normalised |= _sampling(value)
        vocab = load_tokenizer(self.tokenizer).get_vocab_size(with_added_tokens=True)
        for token in normalised.get("logit_bias", {}):
            if int(token) >= vocab:
                raise InputError(
                    f"logit_bias.{token}", f"is no token of {self.name} (its ids are below {vocab})"
                )
        where = "messages" if "messages" in normalised else "prompt"
        prompt_tokens = len(prompt_token_ids(normalised, self.tokenizer))
        context = self.context_tokens
        if prompt_tokens > context:
            raise InputError(
                where,
                f"the prompt has {prompt_tokens} tokens, longer than the context of {context}",
            )
        if prompt_tokens == context:
            raise InputError(
                where,
                f"the prompt has {prompt_tokens} tokens, the whole context of {context}: "
                "none is left to generate",
            )
        room = context - prompt_tokens
        max_tokens = normalised.get("max_tokens")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise InputError(
                "max_tokens",
                f"is {max_tokens}: the prompt's {prompt_tokens} tokens and {max_tokens} leave "
                f"no room in the model's context of {context} tokens (at most {room} here)",
            )
        normalised |= {"max_tokens": max_tokens, "prompt_tokens": prompt_tokens}
        return Validated(input=normalised, cost=prompt_tokens + max_tokens)

    def _prompt(self, value: Mapping[str, Any]) -> dict[str, Any]:
        """``prompt``, or ``messages`` and the prompt the chat template renders of them."""
        if "prompt" in value and "messages" in value:
            raise InputError("messages", "cannot be given with prompt: give one of them")
        if "messages" not in value:
            if "prompt" not in value:
                what = "prompt (a string) or messages" if self.chat else "prompt (a string)"
                raise InputError("prompt", f"is missing: give {what}")
            prompt = value["prompt"]
            if isinstance(prompt, list):
                return self._prompt_ids(prompt)
            if not isinstance(prompt, str):
                raise InputError(
                    "prompt", f"must be a string or token ids, got {json_type(prompt)}"
                )
            if not prompt:
                raise InputError("prompt", "must not be empty")
            if len(prompt) > self.max_chars:
                raise InputError(
                    "prompt", f"is {len(prompt)} characters; the limit is {self.max_chars}"
                )
            return {"prompt": prompt}
        if self.chat is None:
            raise InputError(
                "messages", f"{self.name} has no chat template: give prompt (a string) instead"
            )
        messages = _messages(value["messages"])
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.max_chars:
            raise InputError(
                "messages",
                f"hold {chars} characters of content together; the limit is {self.max_chars}",
            )
        try:
            prompt = self.chat.render(messages, add_generation_prompt=True)
        except TemplateRefused as exc:
            raise InputError("messages", f"the chat template refuses them: {exc}") from None
        return {"prompt": prompt, "messages": messages}

    def _prompt_ids(self, ids: list[Any]) -> dict[str, Any]:
        """A prompt given as token ids: stored as they are, with the text they decode to."""
        if not ids:
            raise InputError("prompt", "must not be empty")
        loaded = load_tokenizer(self.tokenizer)
        vocab = loaded.get_vocab_size(with_added_tokens=True)
        for i, id in enumerate(ids):
            if isinstance(id, bool) or not isinstance(id, int) or not 0 <= id < vocab:
                raise InputError(
                    f"prompt[{i}]", f"must be a token id of {self.name} (0 to {vocab - 1})"
                )
        # The text is for reading (an echo, the job's input); the ids are what runs. A NUL
        # (a byte-level vocabulary's byte 0) is one no database's text column stores.
        text = loaded.decode(ids, skip_special_tokens=False).replace("\x00", "\ufffd")
        return {"prompt": text, "prompt_ids": ids}


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise InputError("messages", f"must be an array of messages, got {json_type(value)}")
    if not value:
        raise InputError("messages", "must hold at least one message")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InputError(
                where, f"must be an object with role and content, got {json_type(message)}"
            )
        for member in message:
            if member not in MESSAGE_MEMBERS:
                raise InputError(f"{where}.{member}", "is not a field of a message (role, content)")
        role, content = message.get("role"), message.get("content")
        if "role" not in message:
            raise InputError(f"{where}.role", "is missing")
        if role == "tool":
            raise InputError(f"{where}.role", "is 'tool': tool messages are not taken")
        if role not in ROLES:
            shown = repr(role) if isinstance(role, str) else json_type(role)
            raise InputError(f"{where}.role", f"is {shown}; one of {', '.join(ROLES)}")
        if "content" not in message:
            raise InputError(f"{where}.content", "is missing")
        if not isinstance(content, str):
            raise InputError(f"{where}.content", f"must be a string, got {json_type(content)}")
        if not content:
            raise InputError(f"{where}.content", "must not be empty")
        messages.append({"role": role, "content": content})
    return messages


def _sampling(value: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling members, checked, with their defaults; null is the same as absent."""
    max_tokens = value.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise InputError(
            "max_tokens", f"must be an integer of at least 1, got {_shown(max_tokens)}"
        )
    temperature = _number(value, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise InputError("temperature", f"must be between 0 and 2 (0: greedy), got {temperature}")
    top_p = _number(value, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise InputError("top_p", f"must be above 0 and at most 1, got {top_p}")
    seed = value.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT
    ):
        raise InputError("seed", f"must be an integer from 0 to 2**63 - 1, got {_shown(seed)}")
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": _stop(value.get("stop")),
        "seed": seed,
    }
    # Stored only when they ask for something: an input without them reads as before.
    for name in PENALTIES:
        penalty = _number(value, name, 0.0)
        if not -PENALTY_LIMIT <= penalty <= PENALTY_LIMIT:
            raise InputError(name, f"must be between -2 and 2, got {penalty}")
        if penalty:
            sampling[name] = penalty
    if bias := _logit_bias(value.get("logit_bias")):
        sampling["logit_bias"] = bias
    for name in ("logprobs", "prompt_logprobs"):
        count = value.get(name)
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_LOGPROBS:
            raise InputError(
                name, f"must be an integer from 0 to {MAX_LOGPROBS}, got {_shown(count)}"
            )
        sampling[name] = count
    return sampling


def token_logprob_entry(
    tokenizer: Path, token: int, logprob: float | None, top: Iterable[tuple[int, float]]
) -> dict[str, Any]:
    """A token's log probability as a job's output and its events carry it: the token,
    its own text and bytes, and the likeliest tokens at its place with theirs (a prompt's
    first token has none: nothing comes before it)."""

    def entry(id: int, value: float | None) -> dict[str, Any]:
        text, bytes_ = _token_text(tokenizer, id)
        return {"token": id, "text": text, "bytes": list(bytes_), "logprob": value}

    return entry(token, logprob) | {"top_logprobs": [entry(id, value) for id, value in top]}


def _byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE's characters back to the bytes they stand for (GPT-2's table)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


BYTE_LEVEL = _byte_level_decoder()
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1 << 16)
def _token_text(tokenizer: Path, id: int) -> tuple[str, tuple[int, ...]]:
    """A token's text and bytes, decoded once per process (a scored prompt's entries are
    thousands, built on the worker's step loop)."""
    loaded = load_tokenizer(tokenizer)
    text = loaded.decode([id], skip_special_tokens=False)
    return text, tuple(_token_bytes(loaded, id, text))


def _token_bytes(tokenizer: Any, id: int, text: str) -> list[int]:
    """A token's own bytes: part of a character where a byte-level token holds one (its
    text then reads "\ufffd"), so that a client can join them back into the text."""
    piece = tokenizer.id_to_token(id) or ""
    if type(tokenizer.decoder).__name__ == "ByteLevel" and all(c in BYTE_LEVEL for c in piece):
        return [BYTE_LEVEL[c] for c in piece]
    if found := BYTE_FALLBACK.fullmatch(piece):
        return [int(found.group(1), 16)]
    return list(text.encode("utf-8"))


def _logit_bias(value: Any) -> dict[str, float]:
    """Token ids (decimal strings, as JSON's keys are) and their biases, checked; the
    zero biases dropped."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(
            "logit_bias", f"must be an object of token ids and numbers, got {json_type(value)}"
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise InputError("logit_bias", f"holds {len(value)} tokens; at most {MAX_LOGIT_BIAS}")
    bias: dict[str, float] = {}
    for token, found in value.items():
        if not (token.isascii() and token.isdigit() and str(int(token)) == token):
            raise InputError("logit_bias", f"has the key {token!r}: keys are token ids, as 50256")
        where = f"logit_bias.{token}"
        if (
            isinstance(found, bool)
            or not isinstance(found, int | float)
            or not math.isfinite(found)
        ):
            raise InputError(where, f"must be a number, got {_shown(found)}")
        number = float(found)
        if not -BIAS_LIMIT <= number <= BIAS_LIMIT:
            raise InputError(where, f"must be between -100 and 100, got {number}")
        if number:
            bias[token] = number
    return bias


def _number(value: Mapping[str, Any], member: str, default: float) -> float:
    found = value.get(member)
    if found is None:
        return default
    if isinstance(found, bool) or not isinstance(found, int | float) or not math.isfinite(found):
        raise InputError(member, f"must be a number, got {_shown(found)}")
    return float(found)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        if not value:
            raise InputError("stop", "must not be an empty string")
        return [value]
    if not isinstance(value, list):
        raise InputError("stop", f"must be a string or an array of strings, got {json_type(value)}")
    if len(value) > MAX_STOPS:
        raise InputError("stop", f"holds {len(value)} strings; at most {MAX_STOPS}")
    for i, stop in enumerate(value):
        if not isinstance(stop, str) or not stop:
            raise InputError(f"stop[{i}]", f"must be a non-empty string, got {_shown(stop)}")
    return list(value)


def _shown(value: Any) -> str:
    """A value in a message: a number as itself, anything else by its JSON type."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return json_type(value)


def generation_spec(model: ModelConfig, number: int | None = None) -> GenerationSpec:
    """``model``'s check for ``number``'s version (None: the active one).

    Reads the version's config.json when model.toml gives no context_tokens,
    and compiles its chat template (core.models.reader checked both already).
    """
    config = model.input
    files = model.version(number).files
    tokenizer = model.tokenizer_path(number)
    if tokenizer is None:
        raise ValueError(f"{model.name}: generation inputs need input.tokenizer")
    template = chat_template_path(config, files)
    return GenerationSpec(
        name=model.name,
        max_chars=config.max_chars,
        tokenizer=tokenizer,
        context_tokens=config.context_tokens or config_context_tokens(files),
        default_max_tokens=config.default_max_tokens,
        chat=load_template(template) if template is not None else None,
    )


def version_problems(config: InputConfig, files: Path) -> list[tuple[str, str]]:
    """What in a version's files keeps a generation model from being checked: (field, why).

    The context length when model.toml gives none, and the chat template:
    the file named, or tokenizer_config.json's when it has one.
    """
    problems = []
    if config.context_tokens is None:
        try:
            config_context_tokens(files)
        except ValueError as exc:
            problems.append(("input.context_tokens", f"is not set, and {exc}"))
    template = chat_template_path(config, files)
    if template is not None:
        if not template.is_file():
            problems.append(("input.chat_template", f"{template.name} is missing"))
        else:
            try:
                load_template(template)
            except ChatTemplateError as exc:
                problems.append(("input.chat_template", f"{template.name} {exc}"))
    return problems
