"""``ferry backfill``: submit a file, follow it with a live bar, fetch its results.

Talks to the HTTP API through the Python client (``ferry_client``), finding
the API and the key as ``ferry.remote`` says. Off a terminal the bars are
plain lines every few seconds (docs/backfills.md shows them).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import typer

from ferry.console import IdArgument, fail, progress_bar
from ferry.remote import ApiOption, KeyOption, connect, remember, reported

if TYPE_CHECKING:
    from ferry_client import Backfill, Client

POLL_S = 1.0
# Status polls and the results stream; the upload's own reads and writes too
# (each of them, not the whole upload: a big file takes as long as it takes).
TIMEOUT_S = 60.0

app = typer.Typer(help="run a file of inputs through a model", no_args_is_help=True)

OutputOption = Annotated[
    str | None, typer.Option("--output", help="results file with --wait (default: stdout)")
]
WaitFlag = Annotated[bool, typer.Option("--wait", help="follow it, then write the results")]


@app.callback()
def _backfill(ctx: typer.Context, api: ApiOption = None, key: KeyOption = None) -> None:
    remember(ctx, api, key)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "--"
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def finished(backfill: Backfill) -> int:
    counts = backfill.request_counts
    return counts.completed + counts.failed + counts.expired + counts.cancelled


def progress_tail(backfill: Backfill, rate: float | None) -> str:
    counts = backfill.request_counts
    parts = [f"{finished(backfill)}/{counts.total}"]
    if rate is not None:
        parts.append(f"{rate:,.0f}/s")
    parts.append(f"ETA {duration(backfill.eta_s)}")
    if counts.failed or counts.expired:
        parts.append(f"failed {counts.failed} expired {counts.expired}")
    return "  ".join(parts)


@app.command("submit", help="upload an NDJSON file")
def submit(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(metavar="FILE", show_default=False)],
    model: Annotated[str, typer.Option("--model", show_default=False)],
    callback_url: Annotated[str | None, typer.Option("--callback-url")] = None,
    wait: WaitFlag = False,
    output: OutputOption = None,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    path = Path(file)
    if not path.is_file():
        raise fail(f"{path} is not a file")
    with reported(by_status=True), connect(ctx, api, key, timeout_s=TIMEOUT_S) as client:
        bar = progress_bar()
        started = time.monotonic()

        def uploaded(sent: int, total: int | None) -> None:
            speed = sent / max(time.monotonic() - started, 1e-6)
            tail = f"{size(sent)}/{size(total or sent)}  {size(speed)}/s"
            bar.show("upload", sent, total or sent, tail)

        try:
            backfill = client.backfills.submit(
                path, model=model, callback_url=callback_url, progress=uploaded
            )
        finally:
            bar.end()
        print(f"backfill {backfill.id}: {backfill.request_counts.total} lines", file=sys.stderr)
        if not wait:
            print(backfill.id)
            return 0
        return _follow(client, backfill.id, output)


def _follow(client: Client, backfill_id: str, output: str | None) -> int:
    bar = progress_bar()
    samples: list[tuple[float, int]] = []
    try:
        while True:
            backfill = client.backfills.get(backfill_id)
            done = finished(backfill)
            now = time.monotonic()
            samples = [(t, d) for t, d in samples if now - t <= 30] + [(now, done)]
            first_t, first_done = samples[0]
            rate = (done - first_done) / (now - first_t) if now - first_t >= 1 else None
            total = backfill.request_counts.total or 1
            bar.show(backfill.status, done, total, progress_tail(backfill, rate))
            if backfill.done:
                bar.end()
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        bar.end()
        print(
            f"\nstopped following; backfill {backfill_id} keeps running.\n"
            f"  follow it:   ferry backfill status {backfill_id} --wait\n"
            f"  results:     ferry backfill results {backfill_id} --output results.ndjson\n"
            f"  cancel it:   ferry backfill cancel {backfill_id}",
            file=sys.stderr,
        )
        return 130
    counts = backfill.request_counts.model_dump()
    print(f"backfill {backfill_id}: {backfill.status}, {counts}", file=sys.stderr)
    _write_results(client, backfill_id, output)
    return 0 if backfill.status == "completed" else 1


def _ndjson(results: Iterable[dict[str, Any]], out: IO[bytes]) -> int:
    """Each result as the API wrote it (compact, UTF-8), one per line; the count."""
    lines = 0
    for result in results:
        out.write(json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode() + b"\n")
        lines += 1
    return lines


def _write_results(client: Client, backfill_id: str, output: str | None) -> None:
    results = client.backfills.results(backfill_id)
    if output is None or output == "-":
        _ndjson(results, sys.stdout.buffer)
        sys.stdout.flush()
    else:
        with open(output, "wb") as out:
            lines = _ndjson(results, out)
        print(f"wrote {lines} results to {output}", file=sys.stderr)


@app.command("status", help="a backfill's progress")
def status(
    ctx: typer.Context,
    id: IdArgument,
    wait: WaitFlag = False,
    output: OutputOption = None,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    with reported(by_status=True), connect(ctx, api, key, timeout_s=TIMEOUT_S) as client:
        if wait:
            return _follow(client, id, output)
        backfill = client.backfills.get(id)
    counts = backfill.request_counts.model_dump()
    print(f"{backfill.id}  {backfill.status}  model {backfill.model}")
    print("  " + progress_tail(backfill, None))
    print("  " + "  ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


@app.command("results", help="the results so far, NDJSON in input order")
def results(
    ctx: typer.Context,
    id: IdArgument,
    output: Annotated[
        str | None, typer.Option("--output", help="file to write (default: stdout)")
    ] = None,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    with reported(by_status=True), connect(ctx, api, key, timeout_s=TIMEOUT_S) as client:
        _write_results(client, id, output)
    return 0


@app.command("cancel", help="stop feeding; the rest is cancelled")
def cancel(
    ctx: typer.Context,
    id: IdArgument,
    api: ApiOption = None,
    key: KeyOption = None,
) -> int:
    with reported(by_status=True), connect(ctx, api, key, timeout_s=TIMEOUT_S) as client:
        backfill = client.backfills.cancel(id)
    print(f"{backfill.id}  {backfill.status}")
    return 0
