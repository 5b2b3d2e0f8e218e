"""A flood at a multiple of a model's capacity, with urgent jobs beside it.

The flood is open loop, as the clients of a real overload are: requests go
out at their rate whatever the answers (a refused request is not retried,
and a slow answer does not slow the next). Its jobs are ``normal`` and
``bulk`` by turns. Urgent probes go out at a steady rate of their own. What
each answer was (its status, its error's type, whether a refusal carried
``Retry-After``) is counted; the latencies come from the jobs table
(accepted to finished), where the API's own time to answer is not counted.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.engine import Engine

from core.db.schema import Job
from harness.submitting import Submitter


@dataclass
class Answers:
    """What a stream of submissions was answered, by lane."""

    accepted: dict[str, list[str]] = field(default_factory=dict)  # lane -> job ids
    refused: Counter[tuple[str, int, str]] = field(default_factory=Counter)  # lane, status, type
    without_retry_after: int = 0  # 429s and 503s that did not say when to come back
    errors: Counter[str] = field(default_factory=Counter)  # transport errors, by type
    sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def answer(self, lane: str, response: httpx.Response) -> None:
        with self._lock:
            self.sent += 1
            if response.status_code == 202:
                self.accepted.setdefault(lane, []).append(response.json()["id"])
                return
            kind = ""
            try:
                kind = response.json()["error"]["type"]
            except (ValueError, KeyError, TypeError):
                kind = "(not json)"
            self.refused[(lane, response.status_code, kind)] += 1
            if response.status_code in (429, 503) and "retry-after" not in response.headers:
                self.without_retry_after += 1

    def failed(self, exc: Exception) -> None:
        with self._lock:
            self.sent += 1
            self.errors[type(exc).__name__] += 1

    def ids(self) -> list[str]:
        return [job for jobs in self.accepted.values() for job in jobs]

    def refusals(self, lane: str | None = None, kind: str | None = None) -> int:
        return sum(
            n
            for (their_lane, _status, their_kind), n in self.refused.items()
            if lane in (None, their_lane) and kind in (None, their_kind)
        )


class Client:
    """Submits sim jobs to the API at ``base`` with ``token`` (a client per thread)."""

    def __init__(self, base: str, token: str) -> None:
        self._clients = Submitter(base, token, threading.Event())

    def post(self, lane: str, answers: Answers) -> None:
        client = self._clients.client()
        body = {"model": "sim", "input": {"cost": 1, "tag": uuid.uuid4().hex}, "priority": lane}
        try:
            answers.answer(lane, client.post("/v1/jobs", json=body))
        except httpx.HTTPError as exc:
            answers.failed(exc)


def paced(
    rate: float,
    seconds: float,
    send: Callable[[int], None],
    threads: int,
    stop: threading.Event | None = None,
) -> int:
    """Call ``send(i)`` ``rate`` times a second for ``seconds`` on ``threads`` threads, each
    at its own time (open loop: late calls go out at once, none is skipped); returns how
    many were sent."""
    count = int(rate * seconds)
    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        for i in range(count):
            if stop is not None and stop.is_set():
                count = i
                break
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(send, i)
    return count


def latencies_ms(engine: Engine, ids: list[str]) -> dict[str, float]:
    """Accepted to finished, in milliseconds, of the jobs of ``ids`` that finished."""
    found: dict[str, float] = {}
    with engine.connect() as conn:
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            for job_id, created, finished in conn.execute(
                select(Job.id, Job.created_at, Job.finished_at).where(Job.id.in_(chunk))
            ):
                if finished is not None:
                    found[job_id] = (finished - created).total_seconds() * 1000.0
    return found


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)] if ordered else float("nan")


def summary_ms(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50": round(statistics.median(values), 1) if values else None,
        "p99": round(p99(values), 1) if values else None,
        "max": round(max(values), 1) if values else None,
    }
