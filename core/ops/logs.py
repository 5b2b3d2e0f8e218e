"""Structured logging: one JSON object per line, with the record's extra fields.

Records are formatted where they are logged and written by a thread of their
own (a queue between them), so a slow log sink (a full pipe, a stalled
collector) never stalls the batch loop: past ``QUEUE_RECORDS`` waiting lines
new ones are dropped and counted, not waited for.
"""

from __future__ import annotations

import atexit
import datetime as dt
import json
import logging
import logging.handlers
import queue
import sys
from typing import IO, Any

QUEUE_RECORDS = 10_000

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in record.__dict__.items():
            if name not in _STANDARD and not name.startswith("_"):
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """Hands formatted lines to the writer's queue; a full queue drops the line (counted)."""

    def __init__(self, records: queue.Queue[Any]) -> None:
        super().__init__(records)
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class _Writer(logging.handlers.QueueListener):
    def enqueue_sentinel(self) -> None:
        # The queue may be full: wait for room, as the lines before it are written.
        self.queue.put(self._sentinel, timeout=10)  # type: ignore[attr-defined]


_listener: logging.handlers.QueueListener | None = None


def configure_logging(
    level: str = "INFO",
    process: str | None = None,
    stream: IO[str] | None = None,
    queue_records: int = QUEUE_RECORDS,
) -> DroppingQueueHandler:
    """JSON lines on ``stream`` (stderr), written by a thread of their own."""
    global _listener
    stop_logging()
    writer = logging.StreamHandler(stream or sys.stderr)
    # The line is made by the JSON formatter where it is logged; the writer adds nothing.
    writer.setFormatter(logging.Formatter("%(message)s"))
    records: queue.Queue[Any] = queue.Queue(queue_records)
    handler = DroppingQueueHandler(records)
    handler.setFormatter(JsonFormatter())
    _listener = _Writer(records, writer)
    _listener.start()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if process:
        old_factory = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = old_factory(*args, **kwargs)
            record.process_name = process
            return record

        logging.setLogRecordFactory(factory)
    return handler


def stop_logging() -> None:
    """Write what is queued and stop the writer (at exit, or before configuring again)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None


atexit.register(stop_logging)
