"""``Client`` and ``AsyncClient``: Ferry's HTTP API as methods, with retries and typed answers.

Both share everything but the sending (:class:`_Requests` builds each request
and reads each answer); the async one's methods are coroutines of the same
names. A submission carries an idempotency key the client makes (or the
caller gives), the same on every retry, so a job is stored once however many
times it is sent.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from ferry_client._retry import Retries
from ferry_client.errors import APIConnectionError, BadRequest, error_for
from ferry_client.models import Backfill, Job, Model
from ferry_client.webhooks import verify_webhook

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0
# The longest wait one request asks for by default (the server refuses more
# than its FERRY_MAX_WAIT_S, 60 s by default); longer waits are several requests.
MAX_WAIT_S = 30.0
UPLOAD_CHUNK = 256 * 1024
POLL_S = 1.0

Progress = Callable[[int, int | None], None]  # (done, total or None)


@dataclass(frozen=True)
class _Call:
    """One request, and whether sending it twice is harmless."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    headers: dict[str, str] | None = None
    content: Any = None
    safe_to_repeat: bool = True
    timeout_s: float | None = None  # None: the client's
    # A streamed body can be sent once only: no retry at all, even after a 429.
    retry: bool = True


class _Requests:
    """What both clients share: the requests for each method and the reading of answers."""

    def __init__(
        self, base_url: str | None, api_key: str | None, timeout_s: float, max_wait_s: float
    ) -> None:
        self.base_url = (base_url or os.environ.get("FERRY_API_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key or os.environ.get("FERRY_API_KEY")
        self.timeout_s = timeout_s
        # The longest wait one request asks for; lowered to the server's bound when it says so.
        self.max_wait_s = max_wait_s

    def within(self, wait_s: float | None) -> float | None:
        """``wait_s`` within the longest wait the server allows (as far as the client knows)."""
        return None if wait_s is None else min(wait_s, self.max_wait_s) or None

    def learned_bound(self, error: BadRequest, wait_s: float | None) -> bool:
        """The server refused ``wait_s`` and said its bound: keep it; False if that was not it."""
        bound = error.details.get("max_wait_s")
        if wait_s is None or not isinstance(bound, (int, float)) or not 0 < bound < wait_s:
            return False
        self.max_wait_s = float(bound)
        return True

    def headers(self) -> dict[str, str]:
        headers = {"User-Agent": "ferry-client/0.1"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @staticmethod
    def submit(
        model: str,
        input: Any,
        *,
        priority: str | None,
        deadline_ms: int | None,
        callback_url: str | None,
        metadata: Mapping[str, Any] | None,
        version: int | None,
        idempotency_key: str,
        wait_s: float | None,
    ) -> _Call:
        body: dict[str, Any] = {"model": model, "input": input}
        for name, value in (
            ("priority", priority),
            ("deadline_ms", deadline_ms),
            ("callback_url", callback_url),
            ("metadata", metadata),
            ("version", version),
        ):
            if value is not None:
                body[name] = value
        return _Call(
            "POST",
            "/v1/jobs",
            params={"wait": _seconds(wait_s)} if wait_s else None,
            json=body,
            headers={"Idempotency-Key": idempotency_key},
            timeout_s=(wait_s + 10.0) if wait_s else None,
        )

    @staticmethod
    def get(job_id: str, wait_s: float | None) -> _Call:
        return _Call(
            "GET",
            f"/v1/jobs/{job_id}",
            params={"wait": _seconds(wait_s)} if wait_s else None,
            timeout_s=(wait_s + 10.0) if wait_s else None,
        )

    @staticmethod
    def list_jobs(
        status: str | None, model: str | None, page_size: int, cursor: str | None
    ) -> _Call:
        params: dict[str, Any] = {"limit": page_size}
        for name, value in (("status", status), ("model", model), ("cursor", cursor)):
            if value is not None:
                params[name] = value
        return _Call("GET", "/v1/jobs", params=params)

    @staticmethod
    def upload(model: str, content: Any, callback_url: str | None) -> _Call:
        params = {"model": model} | ({"callback_url": callback_url} if callback_url else {})
        return _Call(
            "POST",
            "/v1/backfills",
            params=params,
            content=content,
            headers={"Content-Type": "application/x-ndjson"},
            safe_to_repeat=False,  # a backfill has no idempotency key: never sent twice
            retry=False,
        )

    def url(self, path: str) -> str:
        return self.base_url + path

    def arguments(self, call: _Call) -> dict[str, Any]:
        """``call`` as the keyword arguments of ``httpx``'s ``request``."""
        return {
            "method": call.method,
            "url": self.url(call.path),
            "params": call.params,
            "json": call.json,
            "content": call.content,
            "headers": call.headers,
            "timeout": call.timeout_s or self.timeout_s,
        }

    @staticmethod
    def retry_in(
        retries: Retries,
        call: _Call,
        attempt: int,
        response: httpx.Response | None,
        error: httpx.TransportError | None,
    ) -> float | None:
        """Seconds to wait before sending ``call`` again; None: its answer stands."""
        repeat = call.retry and retries.should_retry(attempt, response, call.safe_to_repeat)
        if error is not None:
            if not repeat:
                raise APIConnectionError(f"{call.method} {call.path}: {error}") from error
            return retries.delay_s(attempt, None)
        assert response is not None
        if response.is_success or not repeat:
            return None
        return retries.delay_s(attempt, response)

    @staticmethod
    def answer(response: httpx.Response | None) -> Any:
        """The answer's JSON, or the error it carries raised as an exception."""
        assert response is not None
        if response.is_success:
            return response.json() if response.content else None
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        raise error_for(response.status_code, body, response.headers.get("X-Request-ID"))


def _new_key() -> str:
    return f"ferry-client-{uuid.uuid4()}"


def _seconds(value: float) -> str:
    return f"{value:g}"


def _lines(source: str | os.PathLike[str] | Iterable[Mapping[str, Any]]) -> tuple[Any, int | None]:
    """An NDJSON body from a file (streamed) or from an iterable of ``{"custom_id", "input"}``."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return path, path.stat().st_size
    return (
        (json.dumps(line, separators=(",", ":")).encode() + b"\n" for line in source),
        None,
    )


def _chunks(path_or_lines: Any, total: int | None, progress: Progress | None) -> Iterator[bytes]:
    sent = 0
    if isinstance(path_or_lines, Path):
        with path_or_lines.open("rb") as file:
            while chunk := file.read(UPLOAD_CHUNK):
                sent += len(chunk)
                if progress is not None:
                    progress(sent, total)
                yield chunk
        return
    for chunk in path_or_lines:
        sent += len(chunk)
        if progress is not None:
            progress(sent, total)
        yield chunk


def text_progress(stream: IO[str] = sys.stderr) -> Progress:
    """A plain progress line on ``stream`` (the CLI draws a richer one)."""
    last = [0.0]

    def show(done: int, total: int | None) -> None:
        now = time.monotonic()
        if now - last[0] < 0.5 and (total is None or done < total):
            return
        last[0] = now
        share = f" {100 * done / total:5.1f}%" if total else ""
        stream.write(f"\rupload {done / 2**20:8.1f} MiB{share}")
        if total is not None and done >= total:
            stream.write("\n")
        stream.flush()

    return show


def _progress(progress: bool | Progress) -> Progress | None:
    if progress is True:
        return text_progress()
    return progress or None


# --- the synchronous client ----------------------------------------------------


class Client:
    """Ferry's API. ``base_url`` defaults to ``FERRY_API_URL`` (else 127.0.0.1:8000) and
    ``api_key`` to ``FERRY_API_KEY``; ``timeout_s`` bounds each request (a long-poll's own
    wait is added to it); ``retries`` says how often and how long to retry; ``max_wait_s``
    is the longest wait one request asks for (a server that allows less says so, and the
    client keeps to its bound from then on)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: Retries | None = None,
        max_wait_s: float = MAX_WAIT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._requests = _Requests(base_url, api_key, timeout_s, max_wait_s)
        self.retries = retries or Retries()
        self._http = httpx.Client(
            headers=self._requests.headers(), timeout=timeout_s, transport=transport
        )
        self.backfills = Backfills(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> Any:
        for attempt in itertools.count(1):
            response = error = None
            try:
                response = self._http.request(**self._requests.arguments(call))
            except httpx.TransportError as exc:
                error = exc
            delay_s = self._requests.retry_in(self.retries, call, attempt, response, error)
            if delay_s is None:
                return self._requests.answer(response)
            time.sleep(delay_s)
        raise AssertionError("unreachable")

    # Jobs.

    def submit(
        self,
        model: str,
        input: Any,
        *,
        priority: str | None = None,
        deadline_ms: int | None = None,
        callback_url: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        version: int | None = None,
        idempotency_key: str | None = None,
        wait_s: float | None = None,
    ) -> Job:
        """Submit a job; with ``wait_s``, the answer holds it finished if it ends by then."""
        key = idempotency_key or _new_key()
        return Job.model_validate(
            self._waiting(
                lambda s: _Requests.submit(
                    model,
                    input,
                    priority=priority,
                    deadline_ms=deadline_ms,
                    callback_url=callback_url,
                    metadata=metadata,
                    version=version,
                    idempotency_key=key,
                    wait_s=s,
                ),
                wait_s,
            )
        )

    def get(self, job_id: str, *, wait_s: float | None = None) -> Job:
        """The job now, or once it ends within ``wait_s`` (one long-poll)."""
        return Job.model_validate(self._waiting(lambda s: _Requests.get(job_id, s), wait_s))

    def _waiting(self, call: Callable[[float | None], _Call], wait_s: float | None) -> Any:
        """Send a request that waits; a wait above the server's bound is asked again within it."""
        wait_s = self._requests.within(wait_s)
        try:
            return self._send(call(wait_s))
        except BadRequest as exc:
            if not self._requests.learned_bound(exc, wait_s):
                raise
            return self._send(call(self._requests.within(wait_s)))

    def wait(self, job_id: str, *, timeout_s: float | None = None) -> Job:
        """The job once it ends (or as it is after ``timeout_s``; None waits for ever)."""
        until = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = MAX_WAIT_S if until is None else min(MAX_WAIT_S, until - time.monotonic())
            job = self.get(job_id, wait_s=max(left, 0.0) or None)
            if job.done or (until is not None and time.monotonic() >= until):
                return job

    def run(self, model: str, input: Any, *, timeout_s: float | None = None, **submit: Any) -> Job:
        """Submit and wait: one round trip when the job ends within the first wait."""
        first = MAX_WAIT_S if timeout_s is None else min(MAX_WAIT_S, timeout_s)
        started = time.monotonic()
        job = self.submit(model, input, wait_s=first or None, **submit)
        if job.done:
            return job
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - started))
        return self.wait(job.id, timeout_s=left)

    def cancel(self, job_id: str) -> Job:
        return Job.model_validate(self._send(_Call("DELETE", f"/v1/jobs/{job_id}")))

    def jobs(
        self, *, status: str | None = None, model: str | None = None, page_size: int = 50
    ) -> Iterator[Job]:
        """Every job of the key, newest first, a page at a time."""
        cursor = None
        while True:
            page = self._send(_Requests.list_jobs(status, model, page_size, cursor))
            yield from (Job.model_validate(job) for job in page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def models(self) -> list[Model]:
        return [Model.model_validate(m) for m in self._send(_Call("GET", "/v1/models"))["data"]]

    @staticmethod
    def verify_webhook(headers: Mapping[str, str], body: bytes | str, secret: str) -> Any:
        """The event of a delivery signed with ``secret``; raises if forged or stale."""
        return verify_webhook(headers, body, secret)


class Backfills:
    """``client.backfills``: a whole file of inputs through the bulk lane."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def submit(
        self,
        source: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
        *,
        model: str,
        callback_url: str | None = None,
        progress: bool | Progress = False,
    ) -> Backfill:
        """Upload an NDJSON file (or lines ``{"custom_id", "input"}``); the body is streamed."""
        body, total = _lines(source)
        content = _chunks(body, total, _progress(progress))
        return Backfill.model_validate(
            self._client._send(_Requests.upload(model, content, callback_url))
        )

    def get(self, backfill_id: str) -> Backfill:
        return Backfill.model_validate(
            self._client._send(_Call("GET", f"/v1/backfills/{backfill_id}"))
        )

    def wait(
        self, backfill_id: str, *, timeout_s: float | None = None, poll_s: float = POLL_S
    ) -> Backfill:
        """The backfill once it has ended (or as it is after ``timeout_s``)."""
        until = None if timeout_s is None else time.monotonic() + timeout_s
        while not (backfill := self.get(backfill_id)).done:
            if until is not None and time.monotonic() >= until:
                break
            time.sleep(poll_s)
        return backfill

    def cancel(self, backfill_id: str) -> Backfill:
        return Backfill.model_validate(
            self._client._send(_Call("POST", f"/v1/backfills/{backfill_id}/cancel"))
        )

    def results(self, backfill_id: str) -> Iterator[dict[str, Any]]:
        """The results so far, in input order: ``{"custom_id", "status", "output" | "error"}``."""
        requests = self._client._requests
        with self._client._http.stream(
            "GET", requests.url(f"/v1/backfills/{backfill_id}/results")
        ) as response:
            if not response.is_success:
                response.read()
                requests.answer(response)
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)


# --- the asynchronous client ---------------------------------------------------


class AsyncClient:
    """:class:`Client`'s methods as coroutines (``jobs`` and ``backfills.results`` are async
    iterators)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: Retries | None = None,
        max_wait_s: float = MAX_WAIT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
    ) -> None:
        self._requests = _Requests(base_url, api_key, timeout_s, max_wait_s)
        self.retries = retries or Retries()
        self._http = httpx.AsyncClient(
            headers=self._requests.headers(),
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections),
        )
        self.backfills = AsyncBackfills(self)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> Any:
        for attempt in itertools.count(1):
            response = error = None
            try:
                response = await self._http.request(**self._requests.arguments(call))
            except httpx.TransportError as exc:
                error = exc
            delay_s = self._requests.retry_in(self.retries, call, attempt, response, error)
            if delay_s is None:
                return self._requests.answer(response)
            await asyncio.sleep(delay_s)
        raise AssertionError("unreachable")

    async def submit(
        self,
        model: str,
        input: Any,
        *,
        priority: str | None = None,
        deadline_ms: int | None = None,
        callback_url: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        version: int | None = None,
        idempotency_key: str | None = None,
        wait_s: float | None = None,
    ) -> Job:
        key = idempotency_key or _new_key()
        return Job.model_validate(
            await self._waiting(
                lambda s: _Requests.submit(
                    model,
                    input,
                    priority=priority,
                    deadline_ms=deadline_ms,
                    callback_url=callback_url,
                    metadata=metadata,
                    version=version,
                    idempotency_key=key,
                    wait_s=s,
                ),
                wait_s,
            )
        )

    async def get(self, job_id: str, *, wait_s: float | None = None) -> Job:
        return Job.model_validate(await self._waiting(lambda s: _Requests.get(job_id, s), wait_s))

    async def _waiting(self, call: Callable[[float | None], _Call], wait_s: float | None) -> Any:
        wait_s = self._requests.within(wait_s)
        try:
            return await self._send(call(wait_s))
        except BadRequest as exc:
            if not self._requests.learned_bound(exc, wait_s):
                raise
            return await self._send(call(self._requests.within(wait_s)))

    async def wait(self, job_id: str, *, timeout_s: float | None = None) -> Job:
        until = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = MAX_WAIT_S if until is None else min(MAX_WAIT_S, until - time.monotonic())
            job = await self.get(job_id, wait_s=max(left, 0.0) or None)
            if job.done or (until is not None and time.monotonic() >= until):
                return job

    async def run(
        self, model: str, input: Any, *, timeout_s: float | None = None, **submit: Any
    ) -> Job:
        first = MAX_WAIT_S if timeout_s is None else min(MAX_WAIT_S, timeout_s)
        started = time.monotonic()
        job = await self.submit(model, input, wait_s=first or None, **submit)
        if job.done:
            return job
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - started))
        return await self.wait(job.id, timeout_s=left)

    async def cancel(self, job_id: str) -> Job:
        return Job.model_validate(await self._send(_Call("DELETE", f"/v1/jobs/{job_id}")))

    async def jobs(
        self, *, status: str | None = None, model: str | None = None, page_size: int = 50
    ) -> AsyncIterator[Job]:
        cursor = None
        while True:
            page = await self._send(_Requests.list_jobs(status, model, page_size, cursor))
            for job in page["data"]:
                yield Job.model_validate(job)
            cursor = page.get("next_cursor")
            if not cursor:
                return

    async def models(self) -> list[Model]:
        found = await self._send(_Call("GET", "/v1/models"))
        return [Model.model_validate(m) for m in found["data"]]

    @staticmethod
    def verify_webhook(headers: Mapping[str, str], body: bytes | str, secret: str) -> Any:
        return verify_webhook(headers, body, secret)


class AsyncBackfills:
    """``async_client.backfills``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def submit(
        self,
        source: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
        *,
        model: str,
        callback_url: str | None = None,
        progress: bool | Progress = False,
    ) -> Backfill:
        body, total = _lines(source)
        chunks = _chunks(body, total, _progress(progress))

        async def content() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return Backfill.model_validate(
            await self._client._send(_Requests.upload(model, content(), callback_url))
        )

    async def get(self, backfill_id: str) -> Backfill:
        found = await self._client._send(_Call("GET", f"/v1/backfills/{backfill_id}"))
        return Backfill.model_validate(found)

    async def wait(
        self, backfill_id: str, *, timeout_s: float | None = None, poll_s: float = POLL_S
    ) -> Backfill:
        until = None if timeout_s is None else time.monotonic() + timeout_s
        while not (backfill := await self.get(backfill_id)).done:
            if until is not None and time.monotonic() >= until:
                break
            await asyncio.sleep(poll_s)
        return backfill

    async def cancel(self, backfill_id: str) -> Backfill:
        found = await self._client._send(_Call("POST", f"/v1/backfills/{backfill_id}/cancel"))
        return Backfill.model_validate(found)

    async def results(self, backfill_id: str) -> AsyncIterator[dict[str, Any]]:
        requests = self._client._requests
        async with self._client._http.stream(
            "GET", requests.url(f"/v1/backfills/{backfill_id}/results")
        ) as response:
            if not response.is_success:
                await response.aread()
                requests.answer(response)
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)
