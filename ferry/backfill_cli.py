"""``ferry backfill``: submit a file, follow it with a live bar, fetch its results.

Talks to the HTTP API like any client. The API is ``--api`` (or
``FERRY_API_URL``, default ``http://FERRY_API_HOST:FERRY_API_PORT``) and the
key is ``--key`` (or ``FERRY_API_KEY``, else the key ``ferry up`` keeps in the
data directory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx

from core.settings import get_settings

UPLOAD_CHUNK = 256 * 1024
POLL_S = 1.0
DONE = ("completed", "failed", "cancelled")


class Bar:
    """One line on stderr, redrawn in place on a terminal (a line every few seconds otherwise)."""

    def __init__(self, stream: IO[str] = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self._last_plain = 0.0

    def show(self, label: str, done: float, total: float, tail: str) -> None:
        share = min(done / total, 1.0) if total else 0.0
        filled = int(share * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"{label} [{bar}] {share * 100:5.1f}%  {tail}"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
        elif time.monotonic() - self._last_plain >= 5 or share >= 1.0:
            self._last_plain = time.monotonic()
            self.stream.write(line + "\n")
            self.stream.flush()

    def end(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


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


def progress_tail(resource: dict[str, Any], rate: float | None) -> str:
    counts = resource["request_counts"]
    done = counts["completed"] + counts["failed"] + counts["expired"] + counts["cancelled"]
    parts = [f"{done}/{counts['total']}"]
    if rate is not None:
        parts.append(f"{rate:,.0f}/s")
    parts.append(f"ETA {duration(resource.get('eta_s'))}")
    if counts["failed"] or counts["expired"]:
        parts.append(f"failed {counts['failed']} expired {counts['expired']}")
    return "  ".join(parts)


class Client:
    def __init__(self, api: str, key: str) -> None:
        self.http = httpx.Client(
            base_url=api.rstrip("/"),
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(60.0, connect=5.0),
        )

    def check(self, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise SystemExit(f"error: {response.status_code}: {message}")
        return response.json()

    def status(self, backfill_id: str) -> dict[str, Any]:
        return dict(self.check(self.http.get(f"/v1/backfills/{backfill_id}")))

    def results(self, backfill_id: str, out: IO[bytes]) -> int:
        lines = 0
        with self.http.stream("GET", f"/v1/backfills/{backfill_id}/results") as response:
            if response.status_code >= 400:
                response.read()
                self.check(response)
            for chunk in response.iter_bytes():
                out.write(chunk)
                lines += chunk.count(b"\n")
        return lines


def _default_key() -> str:
    if os.environ.get("FERRY_API_KEY"):
        return os.environ["FERRY_API_KEY"]
    path = get_settings().data_dir / "api-key"
    if path.exists():
        return path.read_text().strip()
    raise SystemExit("no API key: pass --key, set FERRY_API_KEY, or run `ferry up` here first")


def _default_api() -> str:
    if os.environ.get("FERRY_API_URL"):
        return os.environ["FERRY_API_URL"]
    settings = get_settings()
    host = "127.0.0.1" if settings.api_host in ("0.0.0.0", "::") else settings.api_host
    return f"http://{host}:{settings.api_port}"


def _client(args: argparse.Namespace) -> Client:
    return Client(args.api or _default_api(), args.key or _default_key())


def _file_chunks(path: Path, bar: Bar) -> Iterator[bytes]:
    total = path.stat().st_size
    sent = 0
    started = time.monotonic()
    with path.open("rb") as stream:
        while chunk := stream.read(UPLOAD_CHUNK):
            sent += len(chunk)
            speed = sent / max(time.monotonic() - started, 1e-6)
            bar.show("upload", sent, total, f"{size(sent)}/{size(total)}  {size(speed)}/s")
            yield chunk
    bar.end()


def cmd_submit(args: argparse.Namespace) -> int:
    client = _client(args)
    path = Path(args.file)
    if not path.is_file():
        raise SystemExit(f"error: {path} is not a file")
    params = {"model": args.model}
    if args.callback_url:
        params["callback_url"] = args.callback_url
    bar = Bar()
    response = client.http.post(
        "/v1/backfills",
        params=params,
        content=_file_chunks(path, bar),
        headers={"Content-Type": "application/x-ndjson"},
        timeout=httpx.Timeout(None, connect=5.0),  # a big file takes as long as it takes
    )
    resource = client.check(response)
    backfill_id = resource["id"]
    print(f"backfill {backfill_id}: {resource['request_counts']['total']} lines", file=sys.stderr)
    if not args.wait:
        print(backfill_id)
        return 0
    return _follow(client, backfill_id, args.output)


def _follow(client: Client, backfill_id: str, output: str | None) -> int:
    bar = Bar()
    samples: list[tuple[float, int]] = []
    try:
        while True:
            resource = client.status(backfill_id)
            counts = resource["request_counts"]
            done = counts["completed"] + counts["failed"] + counts["expired"] + counts["cancelled"]
            now = time.monotonic()
            samples = [(t, d) for t, d in samples if now - t <= 30] + [(now, done)]
            first_t, first_done = samples[0]
            rate = (done - first_done) / (now - first_t) if now - first_t >= 1 else None
            bar.show(resource["status"], done, counts["total"] or 1, progress_tail(resource, rate))
            if resource["status"] in DONE:
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
    print(f"backfill {backfill_id}: {resource['status']}, {counts}", file=sys.stderr)
    _write_results(client, backfill_id, output)
    return 0 if resource["status"] == "completed" else 1


def _write_results(client: Client, backfill_id: str, output: str | None) -> None:
    if output is None or output == "-":
        lines = client.results(backfill_id, sys.stdout.buffer)
        sys.stdout.flush()
    else:
        with open(output, "wb") as out:
            lines = client.results(backfill_id, out)
        print(f"wrote {lines} results to {output}", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.wait:
        return _follow(client, args.id, args.output)
    resource = client.status(args.id)
    counts = resource["request_counts"]
    print(f"{resource['id']}  {resource['status']}  model {resource['model']}")
    print("  " + progress_tail(resource, None))
    print("  " + "  ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    _write_results(_client(args), args.id, args.output)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    client = _client(args)
    resource = client.check(client.http.post(f"/v1/backfills/{args.id}/cancel"))
    print(f"{resource['id']}  {resource['status']}")
    return 0


def add_parser(sub: Any) -> None:
    backfill = sub.add_parser("backfill", help="run a file of inputs through a model")
    backfill.add_argument("--api", help="API base URL (default: FERRY_API_URL or local)")
    backfill.add_argument("--key", help="API key (default: FERRY_API_KEY or ferry up's key)")
    commands = backfill.add_subparsers(dest="backfill_command", required=True)

    submit = commands.add_parser("submit", help="upload an NDJSON file")
    submit.add_argument("file")
    submit.add_argument("--model", required=True)
    submit.add_argument("--callback-url")
    submit.add_argument("--wait", action="store_true", help="follow it, then write the results")
    submit.add_argument("--output", help="results file with --wait (default: stdout)")
    submit.set_defaults(fn=cmd_submit)

    status = commands.add_parser("status", help="a backfill's progress")
    status.add_argument("id")
    status.add_argument("--wait", action="store_true", help="follow it, then write the results")
    status.add_argument("--output", help="results file with --wait (default: stdout)")
    status.set_defaults(fn=cmd_status)

    results = commands.add_parser("results", help="the results so far, NDJSON in input order")
    results.add_argument("id")
    results.add_argument("--output", help="file to write (default: stdout)")
    results.set_defaults(fn=cmd_results)

    cancel = commands.add_parser("cancel", help="stop feeding; the rest is cancelled")
    cancel.add_argument("id")
    cancel.set_defaults(fn=cmd_cancel)
