"""OpenAI's Batch API over backfills: request lines in, output and error lines out.

A batch input file holds one request per line, as OpenAI's Batch API takes
them::

    {"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
     "body": {"model": "minilm", "input": "a text"}}
    {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}]}}

:class:`RequestLines` turns each into a backfill item (one job, one text or
one generation, the request's options kept in the job's metadata), so a
batch runs as a backfill does: in the bulk lane, resumable, counted exactly.
A completions line is checked as ``POST /v1/completions`` checks a request
(``api.openai.generation``), less streaming and Ferry's own fields. Its output and error
files are not stored: :func:`file_lines` renders them from the jobs, in input
order, in OpenAI's line format.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import secrets
from collections.abc import Iterator
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.openai.embeddings import EncodingFormat, as_vector, cut, dimensions_problem, encoded
from api.openai.generation import PATHS as GENERATION_PATHS
from api.openai.generation import (
    Echo,
    ParamError,
    completion_object,
    is_generation_output,
    parse_request,
    usage_of,
)
from core.db.backfills import Item, LineError, checked_item, custom_id, decode_line, terminal_rows
from core.db.schema import Backfill, Job, OpenAIBatch
from core.models.catalog import MAX_JSON_DEPTH, InputError, ModelSpec, text_problem

EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = (EMBEDDINGS, *GENERATION_PATHS)
REQUEST_FIELDS = frozenset({"custom_id", "method", "url", "body"})
BODY_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
REQUEST_SHAPE = '{"custom_id", "method", "url", "body"}'
MAX_USER_CHARS = 256
# OpenAI takes "24h" only; Ferry takes any whole number of hours up to 30 days.
COMPLETION_WINDOW = re.compile(r"^([1-9][0-9]{0,2})h$")
MAX_WINDOW_HOURS = 720
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

# A batch's status in OpenAI's words, from its backfill's. An expiring backfill
# is settling the lines its window left: still in progress to OpenAI's clients.
STATUS = {
    "validating": "validating",
    "in_progress": "in_progress",
    "expiring": "in_progress",
    "finalizing": "finalizing",
    "completed": "completed",
    "failed": "failed",
    "cancelling": "cancelling",
    "cancelled": "cancelled",
    "expired": "expired",
}
# Why a line that never ran is in the error file, in OpenAI's codes.
NOT_RUN = {
    "expired": (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
}
OUTPUT, ERROR = "output", "error"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def window_hours(completion_window: str) -> int:
    """The hours a completion window gives. Raises ValueError with the reason."""
    found = COMPLETION_WINDOW.match(completion_window)
    if not found or int(found.group(1)) > MAX_WINDOW_HOURS:
        raise ValueError(
            f"completion_window: {completion_window!r} must be a whole number of hours "
            f"such as '24h', at most {MAX_WINDOW_HOURS}h"
        )
    return int(found.group(1))


def metadata_problem(metadata: dict[str, str] | None) -> str | None:
    """Why a batch's metadata is refused (OpenAI's limits), or None."""
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_PAIRS:
        return f"at most {MAX_METADATA_PAIRS} pairs"
    for name, value in metadata.items():
        if len(name) > MAX_METADATA_KEY:
            return f"a key is at most {MAX_METADATA_KEY} characters"
        if len(value) > MAX_METADATA_VALUE:
            return f"{name}: a value is at most {MAX_METADATA_VALUE} characters"
    return None


def request_model(raw: bytes, line: int) -> str | None:
    """The model a request line names (None for a blank line). Raises :class:`LineError`."""
    value = decode_line(raw, line, REQUEST_SHAPE)
    if value is None:
        return None
    body = _body(value, line)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise LineError(
            line, "body.model: must be a model's name", code="missing_required_parameter"
        )
    return model


def _body(value: dict[str, Any], line: int) -> dict[str, Any]:
    body = value.get("body")
    if not isinstance(body, dict):
        raise LineError(line, "body: must be a JSON object", code="missing_required_parameter")
    return body


class RequestLines:
    """Turns a batch input file's lines into backfill items for one model.

    ``model`` is the name every line must give in ``body.model`` (the first
    line's: a batch runs on one model, as OpenAI's do); ``spec`` its entry in
    the catalog. Every refusal names the line, the field and why.
    """

    def __init__(
        self, endpoint: str, model: str, spec: ModelSpec, max_depth: int = MAX_JSON_DEPTH
    ) -> None:
        problem = model_problem(endpoint, spec)
        if problem:
            raise ValueError(problem)
        self.endpoint = endpoint
        self.model = model
        self.spec = spec
        self.embeddings = spec.embeddings
        self.max_depth = max_depth

    def __call__(self, raw: bytes, line: int) -> Item | None:
        value = decode_line(raw, line, REQUEST_SHAPE)
        if value is None:
            return None
        unknown = sorted(set(value) - REQUEST_FIELDS)
        if unknown:
            raise LineError(line, f"unknown field(s): {', '.join(unknown)}")
        custom_id(value, line)
        if value.get("method") != "POST":
            raise LineError(line, "method: must be POST", code="invalid_method")
        if value.get("url") != self.endpoint:
            raise LineError(
                line, f"url: must be {self.endpoint}, the batch's endpoint", code="invalid_url"
            )
        body = _body(value, line)
        if body.get("model") != self.model:
            raise LineError(
                line,
                f"body.model: {body.get('model')!r}; a batch runs on one model, and its "
                f"first request names {self.model!r}",
                code="mismatched_model",
            )
        if self.endpoint in GENERATION_PATHS:
            return self._generation(value, body, line)
        unknown = sorted(set(body) - BODY_FIELDS)
        if unknown:
            raise LineError(line, f"body: unknown field(s): {', '.join(unknown)}")
        return checked_item(
            value,
            line,
            self._text(body, line),
            self.spec,
            self.max_depth,
            metadata=self._options(body, line),
            input_field="body.input",
        )

    def _generation(self, value: dict[str, Any], body: dict[str, Any], line: int) -> Item:
        """A completions or chat completions line: its generation input, checked."""
        try:
            asked = parse_request(GENERATION_PATHS[self.endpoint], body, extensions=False)
        except ParamError as exc:
            raise LineError(line, f"body.{exc}") from None
        if asked.stream:
            raise LineError(line, "body.stream: a batch's requests are not streamed")
        if asked.n > 1:
            raise LineError(
                line, f"body.n: must be 1 in a batch's lines, got {asked.n} (a line is one job)"
            )
        if len(asked.prompts) > 1:
            raise LineError(line, "body.prompt: one prompt in a batch's line (a line is one job)")
        identifier = custom_id(value, line)
        for field, part in (("custom_id", identifier), ("body", asked.input)):
            problem = text_problem(part, max_depth=self.max_depth)
            if problem:
                raise LineError(line, f"{field}: must not contain {problem}")
        try:
            checked = self.spec.validate(asked.input)
        except InputError as exc:
            raise LineError(line, f"body.{asked.param(exc.field)}: {exc.message}") from None
        options: dict[str, Any] = {"openai": "batch"}
        if asked.user is not None:
            options["user"] = asked.user
        if asked.echo:  # the output line echoes the prompt (read from the job's input)
            options["echo"] = "prompt" if asked.generated else "prompt_only"
        return Item(line, identifier, checked.input, checked.cost, options)

    def _text(self, body: dict[str, Any], line: int) -> Any:
        text = body.get("input")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str):
            raise LineError(
                line,
                "body.input: one text per request (a string, or a list of one); "
                "put each text on a line of its own",
                code="missing_required_parameter" if text is None else "invalid_request",
            )
        return text

    def _options(self, body: dict[str, Any], line: int) -> dict[str, Any]:
        """What the request's output needs besides the vector (kept in the job's metadata)."""
        options: dict[str, Any] = {"openai": "batch"}
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise LineError(line, "body.encoding_format: must be float or base64")
        if encoding != "float":
            options["encoding_format"] = encoding
        dimensions = body.get("dimensions")
        if dimensions is not None:
            if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
                raise LineError(line, "body.dimensions: must be a positive integer")
            assert self.embeddings is not None  # an embeddings batch's model (model_problem)
            problem = dimensions_problem(self.embeddings, self.spec.name, dimensions)
            if problem:
                raise LineError(line, f"body.dimensions: {problem}")
            options["dimensions"] = dimensions
        user = body.get("user")
        if user is not None:
            if not isinstance(user, str) or len(user) > MAX_USER_CHARS:
                raise LineError(line, f"body.user: a string of at most {MAX_USER_CHARS} characters")
            options["user"] = user
        return options


def model_problem(endpoint: str, spec: ModelSpec) -> str | None:
    """Why ``spec`` cannot serve a batch of ``endpoint`` (None: it can)."""
    if endpoint in GENERATION_PATHS:
        if getattr(spec.input, "kind", None) != "generation":
            return f"{spec.name!r} is not a generation model"
        return None
    if spec.embeddings is None:
        return f"{spec.name!r} does not produce embeddings"
    return None


def role_of(status: str, output: Any) -> str:
    """Which of a batch's files a finished line goes to."""
    made = as_vector(output) is not None or is_generation_output(output)
    return OUTPUT if status == "succeeded" and made else ERROR


def _generated(options: Any) -> bool:
    """Whether a line's answer holds what its job generated (not with max_tokens 0)."""
    return not (isinstance(options, dict) and options.get("echo") == "prompt_only")


def request_line(row: Any, model: str, endpoint: str = EMBEDDINGS) -> dict[str, Any]:
    """A finished job as one line of a batch's output or error file, in OpenAI's format.

    ``row`` has the job's id, custom_id, status, output, error, cost and metadata
    (and created_at, for a completion's ``created``).
    """
    record: dict[str, Any] = {
        "id": f"batch_req_{row.id.replace('-', '')}",
        "custom_id": row.custom_id,
    }
    options = row.metadata_ or {}
    vector = as_vector(row.output) if row.status == "succeeded" else None
    generated = endpoint in GENERATION_PATHS and row.status == "succeeded"
    if generated and is_generation_output(row.output):
        created = getattr(row, "created_at", None)
        body = completion_object(
            GENERATION_PATHS[endpoint],
            row.id,
            int(created.timestamp()) if created is not None else 0,
            model,
            row.output,
            Echo(row.input["prompt"], _generated(options)) if options.get("echo") else None,
        )
        record["response"] = {"status_code": 200, "request_id": row.id, "body": body}
        record["error"] = None
    elif vector is not None and endpoint == EMBEDDINGS:
        format_: EncodingFormat = options.get("encoding_format", "float")
        body = {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": 0,
                    "embedding": encoded(cut(vector, options.get("dimensions")), format_),
                }
            ],
            "model": model,
            "usage": {"prompt_tokens": row.cost, "total_tokens": row.cost},
        }
        record["response"] = {"status_code": 200, "request_id": row.id, "body": body}
        record["error"] = None
    elif row.status in NOT_RUN:
        code, message = NOT_RUN[row.status]
        record["response"] = None
        record["error"] = {"code": code, "message": message}
    else:
        code = "job_failed" if row.status == "failed" else "bad_output"
        wanted = "a completion" if endpoint in GENERATION_PATHS else "a vector"
        message = row.error if row.status == "failed" else f"the model's output is not {wanted}"
        error = {"message": message, "type": "server_error", "param": None, "code": code}
        record["response"] = {"status_code": 500, "request_id": row.id, "body": {"error": error}}
        record["error"] = None
    return record


def file_lines(
    sessions: sessionmaker[Session],
    backfill_id: str,
    model: str,
    role: str,
    endpoint: str = EMBEDDINGS,
) -> Iterator[bytes]:
    """A batch's output or error file, in input order, a page of lines at a time."""
    columns: tuple[Any, ...] = (
        Job.id,
        Job.custom_id,
        Job.output,
        Job.error,
        Job.cost,
        Job.metadata_,
        Job.created_at,
    )
    if GENERATION_PATHS.get(endpoint) == "completions":
        columns += (Job.input,)  # the prompt a line's echo repeats (chat has no echo)
    for rows in terminal_rows(sessions, backfill_id, columns):
        lines = [
            json.dumps(
                request_line(row, model, endpoint), separators=(",", ":"), ensure_ascii=False
            )
            for row in rows
            if role_of(row.status, row.output) == role
        ]
        if lines:
            yield ("\n".join(lines) + "\n").encode()


def generation_tokens(sessions: sessionmaker[Session], backfill_id: str) -> tuple[int, int]:
    """The prompt and completion tokens of a generation batch's lines that ran, from
    each job's usage (its cost counts max_tokens, not what was made)."""
    prompt = completion = 0
    for rows in terminal_rows(sessions, backfill_id, (Job.output, Job.metadata_)):
        for row in rows:
            if row.status == "succeeded" and is_generation_output(row.output):
                usage = usage_of(row.output, _generated(row.metadata_))
                prompt += usage["prompt_tokens"]
                completion += usage["completion_tokens"]
    return prompt, completion


def input_tokens(session: Session, backfill_id: str) -> int:
    """The tokens of the requests that ran (the model's own count)."""
    total = session.scalar(
        select(func.coalesce(func.sum(Job.cost), 0)).where(
            Job.backfill_id == backfill_id, Job.status == "succeeded"
        )
    )
    return int(total or 0)


def _unix(moment: dt.datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def batch_object(
    batch: OpenAIBatch,
    backfill: Backfill | None,
    files: dict[str, str],
    tokens: int | None = None,
    output_tokens: int = 0,
) -> dict[str, Any]:
    """OpenAI's batch object. ``files``: the ids of its output and error files that exist;
    ``tokens``: the input tokens once it has finished (and ``output_tokens``, the
    tokens its completions made)."""
    status = "failed" if backfill is None else STATUS[backfill.status]
    finished = None if backfill is None else backfill.finished_at
    errors = None
    if batch.errors:
        errors = {"object": "list", "data": batch.errors}
    elif backfill is not None and backfill.status == "failed" and backfill.error:
        # Failed for a reason of its own (an upload cut off when the API stopped).
        errors = {
            "object": "list",
            "data": [{"code": "failed", "message": backfill.error, "param": None, "line": None}],
        }
    counts = {"total": 0, "completed": 0, "failed": 0}
    if backfill is not None:
        counts = {
            "total": backfill.total,
            "completed": backfill.completed,
            # Every line ends in one of the two files: what did not succeed is "failed".
            "failed": backfill.failed + backfill.expired + backfill.cancelled,
        }
    usage = None
    if tokens is not None:
        usage = {
            "input_tokens": tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens + output_tokens,
        }
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model,
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": status,
        "output_file_id": files.get(OUTPUT),
        "error_file_id": files.get(ERROR),
        "created_at": _unix(batch.created_at),
        "in_progress_at": _unix(backfill.in_progress_at if backfill else None),
        "expires_at": _unix(backfill.expires_at if backfill else None),
        "finalizing_at": _unix(backfill.finalizing_at if backfill else None),
        "completed_at": _unix(finished if status == "completed" else None),
        "failed_at": _unix(batch.failed_at or (finished if status == "failed" else None)),
        "expired_at": _unix(finished if status == "expired" else None),
        "cancelling_at": _unix(backfill.cancelling_at if backfill else None),
        "cancelled_at": _unix(finished if status == "cancelled" else None),
        "request_counts": counts,
        "usage": usage,
        "metadata": batch.metadata_,
    }
