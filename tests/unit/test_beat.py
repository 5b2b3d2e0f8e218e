"""``ferry celery beat``'s SIGTERM/SIGINT handler (workers/tasks/beat.py)."""

from __future__ import annotations

import contextlib
import shelve
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest
from celery import Celery, beat

from workers.tasks.beat import StoppingBeat


@pytest.fixture
def service(tmp_path: Path) -> Iterator[beat.Service]:
    app = Celery("beat-test", broker="memory://", set_as_current=False)
    app.conf.beat_schedule = {"tick": {"task": "beat-test.tick", "schedule": 60.0}}
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    service = beat.Service(app, schedule_filename=str(tmp_path / "schedule"), remote_control=False)
    try:
        yield service
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)


def _handler(service: beat.Service) -> Callable[[int, FrameType | None], object]:
    StoppingBeat(app=service.app).install_sync_handler(service)
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler) and signal.getsignal(signal.SIGINT) is handler
    return handler


def test_the_signal_stops_the_loop_and_leaves_the_schedule_to_it(service: beat.Service) -> None:
    scheduler = service.scheduler
    handler = _handler(service)
    with pytest.raises(SystemExit):
        handler(signal.SIGTERM, None)
    # Still open: the code the signal interrupted may read it (celery's handler closes it).
    assert "tick" in scheduler.schedule
    scheduler.close()


def test_a_dropped_system_exit_still_ends_beat_cleanly_with_the_schedule_saved(
    service: beat.Service, tmp_path: Path
) -> None:
    scheduler = service.scheduler
    handler = _handler(service)
    # As when the signal lands in a finalizer: the SystemExit is printed and dropped
    # there, and the loop goes on.
    with contextlib.suppress(SystemExit):
        handler(signal.SIGTERM, None)
    service.start()  # returns at its next pass, closing the schedule once; no ValueError
    with shelve.open(str(tmp_path / "schedule")) as saved:
        assert "tick" in saved["entries"]
    assert scheduler._store is not None
    with pytest.raises(ValueError, match="closed shelf"):
        scheduler._store["entries"]
