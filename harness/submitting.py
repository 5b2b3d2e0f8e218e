"""Bursts of submissions to the API, retried as a careful client retries them."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness import webclient


@dataclass
class Submission:
    """What a burst of submissions got: the accepted ids, in the order of the bodies."""

    ids: dict[int, str] = field(default_factory=dict)
    retried: Counter[str] = field(default_factory=Counter)  # 503s and transport errors
    # Each 503's error type and Retry-After ("" when it had none).
    unavailable: Counter[tuple[str, str]] = field(default_factory=Counter)
    rejected: list[tuple[int, int, str]] = field(default_factory=list)  # (index, status, body)
    seconds: float = 0.0  # how long submitting took
    # Retried after a 503 or a dropped connection, then answered with the job
    # the failed attempt had created after all (Idempotent-Replayed: true).
    replayed: list[int] = field(default_factory=list)

    @property
    def accepted(self) -> list[str]:
        return [self.ids[i] for i in sorted(self.ids)]


class Submitter:
    """Submits jobs to the API at ``base`` with ``token``, until ``stop`` is set."""

    # False: a new connection a request, so that requests spread over API processes that
    # share a port (SO_REUSEPORT hashes connections, not requests), as a load balancer's.
    keepalive = True

    def __init__(self, base: str, token: str, stop: threading.Event) -> None:
        self.base = base
        self.token = token
        self._stop = stop
        self._local = threading.local()  # one client per submitting thread

    def client(self) -> httpx.Client:
        """This thread's HTTP client (one per submitting thread)."""
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = webclient.client(
                base_url=self.base,
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=httpx.Timeout(10.0, connect=2.0),
                # httpx's own limits, less the kept connections where asked.
                limits=httpx.Limits(
                    max_connections=100, max_keepalive_connections=20 if self.keepalive else 0
                ),
            )
            self._local.client = client
        return client

    def submit_one(
        self, body: dict[str, Any], into: Submission, index: int, retry_s: float
    ) -> None:
        """POST until a 202, retrying 503s and dropped connections with the same idempotency key.

        A client that lost its answer cannot know whether the job was accepted;
        the idempotency key makes the retry return the original job instead of
        a second one.
        """
        key = uuid.uuid4().hex
        until = time.monotonic() + retry_s
        pause = 0.1
        while not self._stop.is_set():
            try:
                response = self.client().post(
                    "/v1/jobs", json=body, headers={"Idempotency-Key": key}
                )
            except httpx.TransportError as exc:
                into.retried[type(exc).__name__] += 1
            else:
                if response.status_code == 202:
                    into.ids[index] = str(response.json()["id"])
                    if response.headers.get("Idempotent-Replayed") == "true":
                        into.replayed.append(index)
                    return
                if response.status_code != 503:
                    into.rejected.append((index, response.status_code, response.text[:500]))
                    return
                into.retried["503"] += 1
                into.unavailable[
                    (_error_type(response), response.headers.get("Retry-After", ""))
                ] += 1
            if time.monotonic() > until:
                into.rejected.append((index, 0, "gave up retrying"))
                return
            self._stop.wait(pause)
            pause = min(pause * 2, 1.0)

    def submit(
        self, bodies: list[dict[str, Any]], threads: int = 6, retry_s: float = 60.0
    ) -> Submission:
        submission = Submission()
        started = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            for index, body in enumerate(bodies):
                pool.submit(self.submit_one, body, submission, index, retry_s)
        submission.seconds = time.monotonic() - started
        return submission

    def submit_in_background(
        self,
        bodies: list[dict[str, Any]],
        threads: int = 6,
        retry_s: float = 60.0,
        rate_per_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> tuple[Submission, Future[None]]:
        """Submit ``bodies`` on a thread of their own, all at once or, with ``rate_per_s``,
        each at its time (until ``stop`` is set: those not sent by then never are)."""
        submission = Submission()
        pool = ThreadPoolExecutor(threads)
        halt = stop or threading.Event()

        def all_of_them() -> None:
            started = time.monotonic()
            futures = []
            for index, body in enumerate(bodies):
                if rate_per_s is not None:
                    due = started + index / rate_per_s - time.monotonic()
                    if halt.wait(max(0.0, due)):
                        break
                futures.append(pool.submit(self.submit_one, body, submission, index, retry_s))
            for future in futures:
                future.result()
            pool.shutdown()
            submission.seconds = time.monotonic() - started

        runner = ThreadPoolExecutor(1)
        done = runner.submit(all_of_them)
        runner.shutdown(wait=False)
        return submission, done


def _error_type(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return ""
