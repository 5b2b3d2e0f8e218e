"""``ferry jobs``: submit, get, wait for, cancel and list jobs through the HTTP API.

Built on the Python client (``ferry_client``); the API and key are found as
``ferry.remote`` says. A job prints as ``field  value`` lines (a grid on a
terminal), a list as a table; ``--json`` prints the API's own objects. The
commands that wait exit 0 when the job succeeded and 1 when it ended
otherwise or was still unfinished at the end of the wait, as ``ferry
backfill --wait`` does for a backfill.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ferry.console import IdArgument, print_json, show_fields, show_table
from ferry.remote import ApiOption, JsonOption, KeyOption, connect, remember, reported

if TYPE_CHECKING:
    from ferry_client import Job

# The most jobs one page of GET /v1/jobs holds.
PAGE_LIMIT = 200

app = typer.Typer(help="submit, get, wait for, cancel and list jobs", no_args_is_help=True)
WaitOption = Annotated[
    float | None,
    typer.Option("--wait", metavar="S", min=0, help="wait up to S seconds for it to end"),
]


@app.callback()
def _jobs(ctx: typer.Context, api: ApiOption = None, key: KeyOption = None) -> None:
    remember(ctx, api, key)


def json_input(ctx: typer.Context, text: str) -> Any:
    """INPUT_JSON: JSON text, or ``-`` to read it from stdin."""
    try:
        return json.loads(sys.stdin.read() if text == "-" else text)
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON ({exc})", ctx, param_hint="INPUT_JSON") from None


# A job's fields in the order a person reads them (--json prints them all, as the API does).
FIELDS = (
    "id",
    "model",
    "status",
    "priority",
    "model_version",
    "requested_version",
    "created_at",
    "started_at",
    "finished_at",
    "deadline_at",
    "attempts",
    "estimated_wait_ms",
    "error",
    "output",
    "metadata",
    "batch",
    "timings",
    "callback",
)


def show_job(job: Job, as_json: bool) -> None:
    found = job.model_dump(mode="json")
    if as_json:
        print_json(found)
        return
    shown = [(name, found.get(name)) for name in FIELDS]
    show_fields([(name, _text(value)) for name, value in shown if _known(value)])


def _known(value: Any) -> bool:
    """Worth a line: not null, and not an object whose every field is null."""
    if isinstance(value, dict):
        return any(v is not None for v in value.values())
    return value is not None


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _when(moment: dt.datetime) -> str:
    """To the second, in UTC, one word (a plain table's columns split on spaces)."""
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def waited(job: Job) -> int:
    """The exit status of a command that waited for ``job``."""
    return 0 if job.status == "succeeded" else 1


@app.command("submit", help="submit a job and print it (with --wait: once it ends)")
def submit(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(metavar="MODEL", show_default=False)],
    input_json: Annotated[
        str,
        typer.Argument(
            metavar="INPUT_JSON",
            help="the job's input as JSON ('-': read from stdin)",
            show_default=False,
        ),
    ],
    priority: Annotated[
        str | None,
        typer.Option("--priority", help="its lane: urgent, vip, normal (the default) or bulk"),
    ] = None,
    deadline_ms: Annotated[
        int | None,
        typer.Option("--deadline-ms", min=1, help="expire it if not started within this"),
    ] = None,
    wait: WaitOption = None,
    as_json: JsonOption = False,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    input = json_input(ctx, input_json)
    with reported(), connect(ctx, api, key) as client:
        if wait:
            # One round trip when it ends within the first long-poll.
            job = client.run(
                model, input, timeout_s=wait, priority=priority, deadline_ms=deadline_ms
            )
        else:
            job = client.submit(model, input, priority=priority, deadline_ms=deadline_ms)
    show_job(job, as_json)
    return waited(job) if wait else 0


@app.command("get", help="a job as it is now (with --wait: once it ends)")
def get(
    ctx: typer.Context,
    id: IdArgument,
    wait: WaitOption = None,
    as_json: JsonOption = False,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    with reported(), connect(ctx, api, key) as client:
        job = client.wait(id, timeout_s=wait) if wait else client.get(id)
    show_job(job, as_json)
    return waited(job) if wait else 0


@app.command("wait", help="wait for a job to end and print it")
def wait_for(
    ctx: typer.Context,
    id: IdArgument,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", metavar="S", min=0, help="give up after S seconds"),
    ] = None,
    as_json: JsonOption = False,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    with reported(), connect(ctx, api, key) as client:
        job = client.wait(id, timeout_s=timeout)
    show_job(job, as_json)
    return waited(job)


@app.command("cancel", help="cancel a job that has not ended and print it")
def cancel(
    ctx: typer.Context,
    id: IdArgument,
    as_json: JsonOption = False,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    with reported(), connect(ctx, api, key) as client:
        job = client.cancel(id)
    show_job(job, as_json)
    return 0


@app.command("list", help="the key's jobs, newest first")
def list_jobs(
    ctx: typer.Context,
    status: Annotated[
        str | None,
        typer.Option(
            "--status",
            help="only these: waiting, queued, running, succeeded, failed, expired or cancelled",
        ),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="only this model's")] = None,
    limit: Annotated[int, typer.Option("--limit", metavar="N", min=1, help="at most N")] = 20,
    as_json: JsonOption = False,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    with reported(), connect(ctx, api, key) as client:
        found = client.jobs(status=status, model=model, page_size=min(limit, PAGE_LIMIT))
        jobs = list(itertools.islice(found, limit))
    if as_json:
        for job in jobs:
            print_json(job.model_dump(mode="json"))
        return 0
    rows = [
        (
            job.id,
            job.model,
            job.status,
            job.priority,
            _when(job.created_at),
            job.finished_at and _when(job.finished_at),
        )
        for job in jobs
    ]
    show_table(("id", "model", "status", "priority", "created", "finished"), rows)
    return 0
