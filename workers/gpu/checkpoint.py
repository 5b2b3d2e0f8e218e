"""A generation worker's token writes: each job's tokens to its events stream, its checkpoint.

The events stream is both what a streaming client reads and what a worker
taking a job over goes on from (``core.streams.events``). :class:`TokenWriter`
holds the tokens a step produced and writes them, in one script call
(``append_tokens``) with the streams' expiries, when they are due: once a job
has ``every_tokens`` tokens not yet written, or ``every_ms`` after the last
write, and at once for a job's first token (a client waits for it) and before
anything is recorded as ended (a done event follows the tokens). With the
defaults (1 token, 0 ms) every step's tokens are written in that step.

Pipelined, the write runs on a thread of its own while the next step
computes. One write at most is in flight: the next waits for it, and what it
raised (Redis gone) is raised then, in the loop. So a checkpoint lags the
device by one write at most, and a worker that dies loses at most the tokens
of the write in flight and those not yet due.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import redis

from core.streams.events import JobEvent, append_tokens, run_appends
from workers.gpu.pipelined import Pipelined


class TokenWriter:
    """Writes generations' tokens to their events streams when due (module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        every_tokens: int = 1,
        every_ms: float = 0.0,
        pipelined: bool = False,
        name: str = "tokens",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_tokens < 1 or every_ms < 0:
            raise ValueError("every_tokens must be at least 1 and every_ms at least 0")
        self.client = client
        self.every_tokens = every_tokens
        self.every_ms = every_ms
        self.clock = clock
        self._appends: Pipelined[list[Any]] = Pipelined(f"append-{name}", pipelined)
        self._tokens: list[tuple[str, JobEvent]] = []
        self._unwritten: dict[str, int] = {}  # stream -> its tokens not yet written
        self._expiries: dict[str, int] = {}  # stream -> its expiry (s), set at the next write
        self._written_at = clock()
        self.writes = 0

    @property
    def in_flight(self) -> Future[list[Any]] | None:
        """The write handed to the writer's thread and not yet waited for."""
        return self._appends.in_flight

    @property
    def unwritten(self) -> int:
        """Tokens held, not yet handed to Redis."""
        return len(self._tokens)

    def add(self, key: str, event: JobEvent) -> None:
        """A token of the stream ``key``, written when due."""
        self._tokens.append((key, event))
        self._unwritten[key] = self._unwritten.get(key, 0) + 1

    def expire(self, key: str, ttl_s: int) -> None:
        """Set the stream's expiry with the next write."""
        self._expiries[key] = ttl_s

    def due(self) -> bool:
        """Whether what is held is due (``every_tokens`` of one stream, or ``every_ms``)."""
        if not self._tokens and not self._expiries:
            return False
        if self._unwritten and max(self._unwritten.values()) >= self.every_tokens:
            return True
        return (self.clock() - self._written_at) * 1000.0 >= self.every_ms

    def step(self, urgent: bool = False) -> None:
        """After a step: write what is held if it is due, or ``urgent`` (a first token)."""
        if urgent or self.due():
            self.write()

    def write(self) -> None:
        """Hand what is held to Redis now: in this thread, or (pipelined) on the writer's
        once the write before it is done (what that one raised is raised here)."""
        if not self._tokens and not self._expiries:
            return
        pipe = self.client.pipeline(transaction=False)
        append_tokens(pipe, self._tokens)  # the tokens, then the expiries of their streams
        for key, ttl_s in self._expiries.items():
            pipe.expire(key, ttl_s)
        self._tokens, self._unwritten, self._expiries = [], {}, {}
        self._written_at = self.clock()
        self.writes += 1
        self.wait()
        self._appends.submit(run_appends, self.client, pipe)

    def wait(self) -> None:
        """Until the write in flight is done; re-raises what it raised."""
        self._appends.wait()

    def done(self) -> bool:
        """Whether a write was in flight and has finished (what it raised is for ``wait``)."""
        return self._appends.done()

    def discard(self) -> None:
        """Forget what is held (the jobs are read again, and go on from their streams)."""
        self._tokens, self._unwritten, self._expiries = [], {}, {}

    def close(self) -> None:
        self._appends.close()
