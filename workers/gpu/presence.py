"""A GPU worker as Flower sees it: a Celery worker whose tasks are its micro-batches.

The batch loop is not a Celery worker (it reads Redis Streams, not a Celery
queue), so it speaks Celery's event protocol itself: ``worker-online``, a
``worker-heartbeat`` every ``HEARTBEAT_S`` and ``worker-offline`` on a clean stop,
under a Celery node name ``ferry-<model>@<consumer>``; and for each batch the
``task-received`` / ``task-started`` / ``task-succeeded`` or ``task-failed`` events
of a task whose id is the batch id and whose name is ``ferry.batch.<model>``.
Anything that reads Celery events (Flower, ``celery events``) shows them.

Events are sent from a thread of their own: the batch loop only puts them on
a bounded queue, so a slow or unreachable broker never delays a batch. While
the broker is unreachable, events are dropped (Flower then shows the worker
offline, which is the truth as far as it can tell).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import celery
from celery import Celery

from core.ops.metrics import EVENTS_DROPPED
from workers.gpu.events import BatchFinished, BatchObserver, BatchStarted

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
QUEUE_MAX = 10_000
RECONNECT_S = 2.0
SOFTWARE = {"sw_ident": "ferry-worker", "sw_ver": celery.__version__, "sw_sys": os.uname().sysname}


def node_name(model: str, consumer: str) -> str:
    """The Celery node name a GPU worker shows under (Celery node names are name@host)."""
    return f"ferry-{model}@{consumer}"


def task_name(model: str) -> str:
    return f"ferry.batch.{model}"


class CeleryPresence(BatchObserver):
    """Sends one GPU worker's Celery events: its heartbeat and its batches (an observer of them)."""

    def __init__(
        self,
        app: Celery,
        model: str,
        consumer: str,
        heartbeat_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app = app
        self.model = model
        self.hostname = node_name(model, consumer)
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.dropped = 0
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(QUEUE_MAX)
        self._thread: threading.Thread | None = None
        self._dispatcher: Any = None
        self._connection: Any = None
        self._broken_until = 0.0
        self._stopping = threading.Event()
        # Read by the remote-control thread (workers.gpu.control); each is replaced whole.
        self.processed = 0
        self.current: dict[str, Any] | None = None
        # Batches start on the loop's thread and finish on its recording thread.
        self._counts = threading.Lock()

    # The batch loop's side (observer hooks): never blocks.

    def batch_started(self, batch: BatchStarted) -> None:
        lanes = [job.lane for job in batch.jobs]
        self.task_started(batch.batch_id, len(lanes), sum(batch.costs), lanes, batch.predicted_s)

    def batch_finished(self, batch: BatchFinished) -> None:
        self.task_finished(batch.batch_id, batch.runtime_s, len(batch.jobs), batch.failed)

    def batch_failed(self, batch_id: str, runtime_s: float, size: int, error: str) -> None:
        self.task_finished(batch_id, runtime_s, size, size, error=error)

    def task_started(
        self, batch_id: str, size: int, cost: int, lanes: Sequence[str], predicted_s: float
    ) -> None:
        now = self.clock()
        counts = {lane: lanes.count(lane) for lane in dict.fromkeys(lanes)}
        kwargs = {
            "size": size,
            "cost": cost,
            "lanes": counts,
            "predicted_ms": round(predicted_s * 1000.0, 2),
        }
        with self._counts:
            self.current = {
                "id": batch_id,
                "name": task_name(self.model),
                "args": "()",
                "kwargs": repr(kwargs),
                "time_start": now,
            }
        self._put(
            "task-received",
            uuid=batch_id,
            name=task_name(self.model),
            args="()",
            kwargs=repr(kwargs),
            retries=0,
            eta=None,
            expires=None,
            root_id=batch_id,
            parent_id=None,
            timestamp=now,
        )
        self._put("task-started", uuid=batch_id, timestamp=now)

    def task_finished(
        self, batch_id: str, runtime_s: float, size: int, failed: int, error: str | None = None
    ) -> None:
        """``failed``: jobs of the batch that failed; ``error``: why the batch itself broke off."""
        with self._counts:
            # The recording thread finishes batch N after batch N + 1 started.
            if self.current is not None and self.current["id"] == batch_id:
                self.current = None
            self.processed += 1
        now = self.clock()
        if error is None and failed:
            # A batch whose jobs failed is a failed task: that is what an operator
            # looks for in Flower. Its mates' results are stored all the same.
            error = f"JobsFailed('{failed} of {size} jobs failed')"
        if error is not None:
            self._put(
                "task-failed",
                uuid=batch_id,
                exception=error,
                traceback="",
                runtime=runtime_s,
                timestamp=now,
            )
        else:
            result = {"succeeded": size}
            self._put(
                "task-succeeded",
                uuid=batch_id,
                result=repr(result),
                runtime=runtime_s,
                timestamp=now,
            )

    def _put(self, kind: str, **fields: Any) -> None:
        try:
            self._queue.put_nowait((kind, fields))
        except queue.Full:
            self._dropped(kind)

    def _dropped(self, kind: str) -> None:
        EVENTS_DROPPED.labels(self.model).inc()
        self.dropped += 1

    # The sender thread.

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery-events", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then ``worker-offline``; returns within about ``timeout_s``."""
        if self._thread is None:
            return
        self._stopping.set()
        # Wakes the sender if it waits on an empty queue; a full one is drained anyway.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        self._send("worker-online", self._worker_fields())
        next_beat = time.monotonic() + self.heartbeat_s
        while True:
            try:
                item = self._queue.get(timeout=max(next_beat - time.monotonic(), 0.0))
            except queue.Empty:
                item = None if self._stopping.is_set() else ("worker-heartbeat", {})
            if item is None and self._stopping.is_set() and self._queue.empty():
                # Even right after a failure, the goodbye is worth one try.
                self._broken_until = 0.0
                self._send("worker-offline", self._worker_fields())
                self._close()
                return
            beat = item is not None and item[0] == "worker-heartbeat"
            if item is not None and not beat:
                self._send(*item)
            # A backlog of batch events must not starve the heartbeat.
            if beat or time.monotonic() >= next_beat:
                self._send("worker-heartbeat", self._worker_fields())
                next_beat = time.monotonic() + self.heartbeat_s

    def _worker_fields(self) -> dict[str, Any]:
        return {
            "freq": self.heartbeat_s,
            "active": 0 if self.current is None else 1,
            "processed": self.processed,
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            **SOFTWARE,
        }

    def _send(self, kind: str, fields: dict[str, Any]) -> None:
        if time.monotonic() < self._broken_until:
            self._dropped(kind)
            return
        try:
            if self._dispatcher is None:
                self._connection = self.app.connection_for_write()
                self._dispatcher = self.app.events.Dispatcher(
                    self._connection, hostname=self.hostname, buffer_while_offline=False
                )
            self._dispatcher.send(kind, **fields)
        except Exception as exc:  # whatever the transport raises; a batch never waits on it
            self._dropped(kind)
            log.warning(
                "celery event not sent; retrying later",
                extra={"model": self.model, "event": kind, "error_type": type(exc).__name__},
            )
            self._close()
            self._broken_until = time.monotonic() + RECONNECT_S

    def _close(self) -> None:
        dispatcher, connection = self._dispatcher, self._connection
        self._dispatcher = self._connection = None
        for part in (dispatcher, connection):
            if part is not None:
                try:
                    part.close()
                except Exception:  # already broken; nothing more to do
                    log.debug("closing the event connection failed", exc_info=True)
