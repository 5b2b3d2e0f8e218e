"""Log lines are JSON, written by a thread of their own: a stalled sink never stalls the caller."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator

import pytest

from core.ops.logs import configure_logging, stop_logging


class StalledSink(io.StringIO):
    """A stream whose writes wait until it is released (a full pipe, a stuck collector)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.release.wait(timeout=30)
        return super().write(text)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, factory = root.handlers[:], root.level, logging.getLogRecordFactory()
    yield
    stop_logging()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.setLogRecordFactory(factory)


def test_a_stalled_sink_does_not_stall_the_logger() -> None:
    sink = StalledSink()
    configure_logging("INFO", "worker-sim", stream=sink)
    log = logging.getLogger("ferry.test")
    logged = threading.Event()

    def log_lines() -> None:
        for n in range(20):
            log.info("batch done", extra={"batch_id": f"b{n}", "size": n})
        logged.set()

    threading.Thread(target=log_lines, daemon=True).start()
    # Every call returned while the sink was still stuck on the first line.
    assert logged.wait(timeout=10)
    assert sink.getvalue() == ""
    sink.release.set()
    stop_logging()  # writes what is queued
    lines = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [line["batch_id"] for line in lines] == [f"b{n}" for n in range(20)]
    assert lines[3]["size"] == 3 and lines[3]["msg"] == "batch done"
    assert lines[0]["level"] == "info" and lines[0]["process_name"] == "worker-sim"


def test_past_the_queue_lines_are_dropped_and_counted_not_waited_for() -> None:
    sink = StalledSink()
    handler = configure_logging("INFO", stream=sink, queue_records=5)
    log = logging.getLogger("ferry.test")
    done = threading.Event()

    def flood() -> None:
        for n in range(50):
            log.warning("line %d", n)
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    assert done.wait(timeout=10)
    # The writer holds one line and the queue five: the rest were dropped.
    assert 50 - 6 <= handler.dropped <= 50 - 5
    sink.release.set()
    stop_logging()
    assert len(sink.getvalue().splitlines()) == 50 - handler.dropped


def test_an_exception_keeps_its_traceback_in_the_line() -> None:
    sink = io.StringIO()
    configure_logging("INFO", stream=sink)
    try:
        raise ValueError("bad input")
    except ValueError:
        logging.getLogger("ferry.test").exception("batch failed", extra={"batch_id": "b1"})
    stop_logging()
    (line,) = [json.loads(text) for text in sink.getvalue().splitlines()]
    assert line["batch_id"] == "b1" and "ValueError: bad input" in line["exc"]
