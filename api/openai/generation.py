"""OpenAI's completions and chat completions, as Ferry's generation jobs.

:func:`parse_request` turns a ``POST /v1/completions`` or
``POST /v1/chat/completions`` body (or a Batch API line's body) into the
generation input of a job (``core.models.generation`` checks it further) and the
options that shape the answer; every refusal is a :class:`ParamError`
naming OpenAI's parameter. A parameter OpenAI defines that Ferry does not
honour (``tools``, ``suffix``, ``best_of`` ...) is refused, not ignored;
its neutral value (``null``, ``tools: []`` ...) is taken, since
clients send those by default. The other functions render a
finished job (or its tokens, as they come) in OpenAI's shapes.

Pure: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from core.models.generation import MEMBERS, SEED_LIMIT
from scheduler.vocabulary import LANES

Endpoint = Literal["chat", "completions"]
PATHS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
OBJECTS = {"chat": "chat.completion", "completions": "text_completion"}
CHUNK_OBJECTS = {"chat": "chat.completion.chunk", "completions": "text_completion"}
ID_PREFIXES = {"chat": "chatcmpl-", "completions": "cmpl-"}

MAX_USER_CHARS = 256
# The most choices (``n``) one request asks for, the most prompts a completions request
# gives, and the most jobs (prompts times choices) it makes: each is a job of its own.
MAX_CHOICES = 16
MAX_PROMPTS = 64
MAX_JOBS = 64
# The most alternatives a token's logprobs may list: OpenAI's limits (chat's top_logprobs,
# the legacy completions' logprobs).
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}
MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000
# Passed on to the generation input as they are (core.models.generation checks them).
# The generation input's members a request gives under the same names (the prompt, the
# messages, max_tokens and logprobs are read apart: OpenAI shapes them otherwise).
# (prompt_logprobs is completions' echo with logprobs.)
SAMPLING = tuple(
    m
    for m in MEMBERS
    if m not in ("prompt", "messages", "max_tokens", "logprobs", "prompt_logprobs")
)
COMMON = frozenset({"model", "n", "user", "stream", "stream_options", *SAMPLING, "max_tokens"})
TAKEN: dict[Endpoint, frozenset[str]] = {
    "completions": COMMON | {"prompt", "logprobs", "echo"},
    "chat": COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
}
# Ferry's own fields beside OpenAI's, on the HTTP routes (a batch line has none).
EXTENSIONS = frozenset({"priority", "deadline_ms", "ferry_cancel_on_disconnect"})
# OpenAI's parameters Ferry does not honour, with the values that ask for nothing
# (null is always one): a client sending those loses nothing.
NEUTRAL: dict[Endpoint, dict[str, tuple[Any, ...]]] = {
    "completions": {"best_of": (1,), "suffix": ("",)},
    "chat": {
        "tools": ([],),
        "tool_choice": ("none",),
        "parallel_tool_calls": (True, False),
        "functions": ([],),
        "function_call": ("none",),
        "response_format": ({"type": "text"},),
        "modalities": (["text"],),
        "audio": (),
        "prediction": (),
        "metadata": ({},),
        "store": (False,),
        "service_tier": ("auto", "default"),
        "reasoning_effort": (),
        "verbosity": (),
        "web_search_options": (),
        "prompt_cache_key": (),
        "safety_identifier": (),
    },
}
# OpenAI's newer name for the system role.
ROLE_NAMES = {"developer": "system"}


class ParamError(ValueError):
    """A request OpenAI's clients sent that Ferry refuses; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)
class GenerationRequest:
    """What one request asks for: the job's input and the answer's shape."""

    endpoint: Endpoint
    input: dict[str, Any]  # a generation input (prompt or messages, sampling)
    stream: bool = False
    include_usage: bool = False  # a usage chunk before [DONE]
    user: str | None = None
    priority: str | None = None
    deadline_ms: int | None = None
    cancel_on_disconnect: bool = False
    max_tokens_param: str = "max_tokens"  # the name the request gave max_tokens under
    # completions' echo: the prompt before the completion, in its text and its logprobs;
    # ``generated`` False: ``max_tokens: 0``, the prompt scored and nothing generated (the
    # job generates one token, which the answer leaves out).
    echo: bool = False
    generated: bool = True
    n: int = 1  # choices of each prompt: one job each
    # completions' prompts (a list of them is a choice, or n, each); ``input`` holds the
    # first.
    prompts: tuple[Any, ...] = ()

    @property
    def choices(self) -> int:
        """The jobs the request makes: n for each of its prompts."""
        return max(1, len(self.prompts)) * self.n

    def choice_input(self, index: int) -> dict[str, Any]:
        """The input of choice ``index``'s job (OpenAI's order: prompt by prompt, n
        choices each): a seed given is each prompt's first choice's, the next ones' the
        seeds after it (so that sampled choices differ, each reproducible)."""
        prompt, draw = divmod(index, self.n)
        found = self.input if prompt == 0 else self.input | {"prompt": self.prompts[prompt]}
        seed = found.get("seed")
        if draw == 0 or not isinstance(seed, int) or isinstance(seed, bool):
            return found
        return found | {"seed": (seed + draw) % SEED_LIMIT}

    def echo_of(self, stored: Mapping[str, Any]) -> Echo | None:
        """What the answer echoes, given the job's stored input."""
        return Echo(stored["prompt"], self.generated) if self.echo else None

    def param(self, field: str) -> str:
        """OpenAI's name for a field of the generation input that its check refused
        (``messages[2].content``, ``stop[1]`` ... are OpenAI's names already)."""
        if field == "input":
            return "messages" if self.endpoint == "chat" else "prompt"
        if field == "max_tokens":
            return self.max_tokens_param
        return field


@dataclass(frozen=True)
class Echo:
    """completions' ``echo``: the prompt's text before the completion's, its tokens'
    logprobs before theirs; ``generated`` False: only the prompt (``max_tokens: 0``)."""

    prompt: str
    generated: bool = True


def parse_request(
    endpoint: Endpoint, body: Mapping[str, Any], *, extensions: bool = True
) -> GenerationRequest:
    """The request ``body`` makes of the endpoint. Raises :class:`ParamError`.

    ``extensions``: whether Ferry's own fields (``priority``, ``deadline_ms``,
    ``ferry_cancel_on_disconnect``) are taken, as they are over HTTP.
    """
    taken = TAKEN[endpoint] | (EXTENSIONS if extensions else frozenset())
    for name, value in body.items():
        if name in taken:
            continue
        neutral = NEUTRAL[endpoint]
        if name in neutral:
            if value is not None and not _neutral(value, neutral[name]):
                raise ParamError(name, f"is not supported by Ferry (got {_shown(value)})")
            continue
        raise ParamError(name, f"is not a parameter of {_path(endpoint)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ParamError("model", "must be a model's name")
    n = body.get("n")
    if n is None:
        n = 1
    elif isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ParamError("n", f"must be an integer from 1 to {MAX_CHOICES}, got {_shown(n)}")
    stream = _flag(body, "stream")
    include_usage = _stream_options(body.get("stream_options"), stream)
    given: dict[str, Any] = {name: body[name] for name in SAMPLING if name in body}
    if endpoint == "chat":
        given["messages"] = _messages(body.get("messages"))
    else:
        prompts = _prompts(body.get("prompt"))
        given["prompt"] = prompts[0]
        if len(prompts) * n > MAX_JOBS:
            raise ParamError(
                "n",
                f"{len(prompts)} prompts of {n} choices are {len(prompts) * n} jobs; "
                f"at most {MAX_JOBS} in one request",
            )
    max_tokens_param = "max_tokens"
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise ParamError("max_tokens", "give max_completion_tokens or max_tokens, not both")
        max_tokens_param = "max_completion_tokens"
    if body.get(max_tokens_param) is not None:
        given["max_tokens"] = body[max_tokens_param]
    logprobs = _logprobs(endpoint, body)
    if logprobs is not None:
        given["logprobs"] = logprobs
    echo = _flag(body, "echo")
    if echo and stream:
        raise ParamError("echo", "is not taken with stream: true")
    generated = True
    zero = given.get("max_tokens") == 0 and not isinstance(given["max_tokens"], bool)
    if zero and endpoint == "completions":  # (chat's is refused with the input's check)
        if not echo:
            raise ParamError(
                max_tokens_param, "0 is only taken with echo: true (the prompt scored alone)"
            )
        given["max_tokens"] = 1
        generated = False
    if echo and logprobs is not None:
        given["prompt_logprobs"] = logprobs
    cancel_on_disconnect = _flag(body, "ferry_cancel_on_disconnect")
    if cancel_on_disconnect and not stream:
        raise ParamError("ferry_cancel_on_disconnect", "is only taken with stream: true")
    return GenerationRequest(
        endpoint=endpoint,
        input=given,
        stream=stream,
        include_usage=include_usage,
        user=_user(body.get("user")),
        priority=_priority(body.get("priority")),
        deadline_ms=_deadline(body.get("deadline_ms")),
        cancel_on_disconnect=cancel_on_disconnect,
        max_tokens_param=max_tokens_param,
        echo=echo,
        generated=generated,
        n=n,
        prompts=tuple(prompts) if endpoint == "completions" else (),
    )


def _path(endpoint: Endpoint) -> str:
    return next(path for path, name in PATHS.items() if name == endpoint)


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # bool is an int: 0 must not stand for False, nor True for 1 (0.0 is 0, though).
    return any(
        value == n
        and isinstance(value, bool) == isinstance(n, bool)
        and type(value) in (type(n), float)
        for n in neutral
    )


def _logprobs(endpoint: Endpoint, body: Mapping[str, Any]) -> int | None:
    """How many alternatives each token's logprob lists (None: no logprobs asked): chat's
    ``logprobs: true`` and ``top_logprobs``, the legacy completions' ``logprobs: k``."""
    most = MAX_TOP_LOGPROBS[endpoint]
    name = "top_logprobs" if endpoint == "chat" else "logprobs"
    count = body.get(name)
    if count is not None and (
        isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= most
    ):
        raise ParamError(name, f"must be an integer from 0 to {most}, got {_shown(count)}")
    if endpoint == "completions":
        return count
    if not _flag(body, "logprobs"):
        if count is not None:
            raise ParamError("top_logprobs", "is only taken with logprobs: true")
        return None
    return count or 0


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ParamError(name, f"must be true or false, got {_shown(value)}")
    return value


def _stream_options(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise ParamError("stream_options", "is only taken with stream: true")
    if not isinstance(value, dict):
        raise ParamError("stream_options", f"must be an object, got {_shown(value)}")
    for name in value:
        if name != "include_usage":
            raise ParamError(f"stream_options.{name}", "is not supported by Ferry")
    include = value.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise ParamError("stream_options.include_usage", "must be true or false")
    return bool(include)


def _prompts(value: Any) -> list[Any]:
    """completions' ``prompt``: a string, token ids, or a list of either (a prompt each)."""
    if value is None:
        raise ParamError("prompt", "is required")
    if isinstance(value, str) or _token_ids(value):
        return [value]
    if not isinstance(value, list) or not value:
        raise ParamError(
            "prompt", f"must be a string, token ids, or a list of either, got {_shown(value)}"
        )
    if not _is_list_of_prompts(value):
        raise ParamError(
            "prompt", "a list holds strings or lists of token ids, one a prompt, all alike"
        )
    if len(value) > MAX_PROMPTS:
        raise ParamError("prompt", f"{len(value)} prompts; at most {MAX_PROMPTS} in one request")
    return list(value)


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    )


def _is_list_of_prompts(value: list[Any]) -> bool:
    return bool(value) and (
        all(isinstance(p, str) for p in value) or all(_token_ids(p) for p in value)
    )


def _messages(value: Any) -> Any:
    """The messages, with OpenAI's text parts joined and its developer role as system;
    anything else is left to core.models.generation's check, which names the member."""
    if value is None:
        raise ParamError("messages", "is required")
    if not isinstance(value, list):
        return value
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            out.append(message)
            continue
        message = dict(message)
        role = message.get("role")
        if isinstance(role, str) and role in ROLE_NAMES:
            message["role"] = ROLE_NAMES[role]
        if isinstance(message.get("content"), list):
            message["content"] = _text_parts(message["content"], f"messages[{i}].content")
        out.append(message)
    return out


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else None
            shown = repr(kind) if isinstance(kind, str) else _shown(part)
            raise ParamError(f"{where}[{j}]", f"only text parts are taken, got {shown}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ParamError(f"{where}[{j}].text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _user(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_USER_CHARS:
        raise ParamError("user", f"must be a string of at most {MAX_USER_CHARS} characters")
    return value


def _priority(value: Any) -> str | None:
    if value is None:
        return None
    if value not in LANES:
        raise ParamError("priority", f"must be one of {', '.join(LANES)}, got {_shown(value)}")
    return str(value)


def _deadline(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DEADLINE_MS:
        raise ParamError(
            "deadline_ms", f"must be an integer from 1 to {MAX_DEADLINE_MS}, got {_shown(value)}"
        )
    return value


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return repr(value[:40])
    return type(value).__name__ if value is not None else "null"


def response_id(endpoint: Endpoint, job_id: str) -> str:
    """The completion's id: the job's, so a client can find the job again."""
    return ID_PREFIXES[endpoint] + job_id.replace("-", "")


def unscored(stored: Mapping[str, Any], output: Mapping[str, Any]) -> bool:
    """Whether a job asked to score its prompt and its output has no scores (it ended
    during its prefill): an echo with logprobs cannot be answered from it."""
    return stored.get("prompt_logprobs") is not None and output.get("prompt_logprobs") is None


def usage_of(output: Mapping[str, Any], generated: bool = True) -> dict[str, int]:
    usage = output.get("usage") or {}
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0)) if generated else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def is_generation_output(output: Any) -> TypeGuard[dict[str, Any]]:
    return (
        isinstance(output, dict)
        and isinstance(output.get("text"), str)
        and isinstance(output.get("usage"), dict)
    )


def completion_object(
    endpoint: Endpoint,
    job_id: str,
    created_s: int,
    model: str,
    output: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    echo: Echo | Sequence[Echo | None] | None = None,
    n: int = 1,
) -> dict[str, Any]:
    """A finished job's output (or the outputs of a request's jobs, a choice each: ``n``
    of each prompt, prompt by prompt) as OpenAI's ``chat.completion`` or
    ``text_completion``; ``echo``: completions' prompt before the choice (one for all, or
    one a choice). Each prompt's tokens are counted once, as OpenAI counts them."""
    outputs = [output] if isinstance(output, Mapping) else list(output)
    echoes = list(echo) if isinstance(echo, Sequence) else [echo] * len(outputs)
    generated = [e is None or e.generated for e in echoes]
    choices = [
        choice_object(endpoint, i, found, e)
        for i, (found, e) in enumerate(zip(outputs, echoes, strict=True))
    ]
    return {
        "id": response_id(endpoint, job_id),
        "object": OBJECTS[endpoint],
        "created": created_s,
        "model": model,
        "choices": choices,
        "usage": total_usage(outputs, n, generated),
        "system_fingerprint": None,
    }


def total_usage(
    outputs: Sequence[Mapping[str, Any]], n: int = 1, generated: Sequence[bool] = ()
) -> dict[str, int]:
    """A request's usage from its choices' outputs (``n`` of each prompt, prompt by
    prompt; ``generated``: False where a choice's token is left out): each prompt's
    tokens counted once, every choice's completion tokens."""
    usages = [
        usage_of(found, generated[i] if generated else True) for i, found in enumerate(outputs)
    ]
    prompt = sum(usage["prompt_tokens"] for usage in usages[::n])
    completion = sum(usage["completion_tokens"] for usage in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def choice_object(
    endpoint: Endpoint, index: int, output: Mapping[str, Any], echo: Echo | None = None
) -> dict[str, Any]:
    """One choice of a completion: a finished job's text, logprobs and finish reason."""
    choice: dict[str, Any] = {"index": index}
    generated = echo is None or echo.generated
    text = output["text"] if generated else ""
    logprobs = output.get("logprobs")
    if not generated and logprobs is not None:
        logprobs = []
    if echo is not None:
        text = echo.prompt + text
        if logprobs is not None:
            logprobs = [*output.get("prompt_logprobs", ()), *logprobs]
    if endpoint == "chat":
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
    else:
        choice["text"] = text
    return choice | {
        "logprobs": None if logprobs is None else logprobs_object(endpoint, logprobs),
        # max_tokens 0: nothing generated, whatever ended the token left out.
        "finish_reason": output.get("finish_reason") if generated else "length",
    }


def chunk_object(
    endpoint: Endpoint,
    job_id: str,
    created_s: int,
    model: str,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One streamed chunk of choice ``index``: a text delta (``role`` on the first chat
    chunk), or the last chunk, with its ``finish_reason`` and no text; ``logprobs``: those
    of the tokens the chunk brings (:func:`logprobs_object`)."""
    choice: dict[str, Any] = {"index": index}
    if endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": response_id(endpoint, job_id),
        "object": CHUNK_OBJECTS[endpoint],
        "created": created_s,
        "model": model,
        "choices": [choice],
        "system_fingerprint": None,
    }


def usage_chunk(
    endpoint: Endpoint, job_id: str, created_s: int, model: str, usage: Mapping[str, int]
) -> dict[str, Any]:
    """The chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
    return {
        "id": response_id(endpoint, job_id),
        "object": CHUNK_OBJECTS[endpoint],
        "created": created_s,
        "model": model,
        "choices": [],
        "usage": dict(usage),
        "system_fingerprint": None,
    }


def logprobs_object(
    endpoint: Endpoint, entries: Sequence[Mapping[str, Any]], offset: int = 0
) -> dict[str, Any]:
    """Tokens' logprobs (a job output's ``logprobs`` entries) in OpenAI's shape: chat's
    ``content`` list, or the legacy completions' parallel lists, whose ``text_offset``
    counts from ``offset`` (the characters of the tokens before these)."""
    if endpoint == "chat":
        return {"content": [_chat_logprob(e, top=True) for e in entries], "refusal": None}
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["text"])
    return {
        "tokens": [e["text"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # The sampled token's too, as OpenAI's: up to k + 1 of them (none for an echoed
        # prompt's first token, which has no logprob).
        "top_logprobs": [
            None
            if e["logprob"] is None
            else {t["text"]: t["logprob"] for t in e["top_logprobs"]} | {e["text"]: e["logprob"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


def _chat_logprob(entry: Mapping[str, Any], top: bool) -> dict[str, Any]:
    # A token's text may be part of a character (a byte-level token): its bytes are its
    # own (an entry written before they were kept: those of its text as decoded).
    found = {
        "token": entry["text"],
        "logprob": entry["logprob"],
        "bytes": entry.get("bytes") or list(entry["text"].encode("utf-8", errors="replace")),
    }
    if top:
        found["top_logprobs"] = [_chat_logprob(t, top=False) for t in entry["top_logprobs"]]
    return found
