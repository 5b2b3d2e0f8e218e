"""backends.catalog.LiveVersions.unloaded: which models an operator unloaded, asked at every
submission, answered without waiting for the database once it has been read."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import OperationalError

from backends.catalog import LiveVersions
from core.config.settings import Settings

POLL_S = 0.05


class Sessions:
    """A sessionmaker whose sessions answer the unloads query with ``models`` as they were
    when the session opened, after ``delays`` (one a session, then none), or fail."""

    def __init__(self, *models: str) -> None:
        self.models = set(models)
        self.delays: list[float] = []
        self.down = False
        self.opened = 0

    def __call__(self) -> Session:
        self.opened += 1
        if self.down:
            raise OperationalError("SELECT", {}, ConnectionError("the database is down"))
        return Session(set(self.models), self.delays.pop(0) if self.delays else 0.0)


class Session:
    def __init__(self, models: set[str], delay: float) -> None:
        self.models, self.delay = models, delay

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def scalars(self, _query: Any) -> list[str]:
        time.sleep(self.delay)
        return sorted(self.models)


def live(sessions: Sessions) -> LiveVersions:
    return LiveVersions(Settings(database_url="sqlite://"), sessions, POLL_S)  # type: ignore[arg-type]


def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    until = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < until, "never"
        time.sleep(0.01)


def timed(versions: LiveVersions, model: str) -> tuple[bool, float]:
    start = time.monotonic()
    answer = versions.unloaded(model)
    return answer, time.monotonic() - start


def test_the_first_question_reads_and_later_ones_never_wait_for_the_database() -> None:
    sessions = Sessions("sim")
    versions = live(sessions)
    assert versions.unloaded("sim") and not versions.unloaded("minilm")
    assert sessions.opened == 1  # within the poll interval: no read
    # A slow read: the answer is the last one, at once, while it runs in its thread.
    sessions.models, sessions.delays = set(), [0.5]
    time.sleep(POLL_S)
    answer, took = timed(versions, "sim")
    assert answer and took < 0.1
    eventually(lambda: not versions.unloaded("sim"))


def test_an_outage_keeps_the_last_answer_and_a_first_read_that_fails_finds_none() -> None:
    sessions = Sessions("sim")
    versions = live(sessions)
    assert versions.unloaded("sim")
    sessions.down = True
    time.sleep(POLL_S)
    opened = sessions.opened
    eventually(lambda: versions.unloaded("sim") and sessions.opened > opened)
    down = Sessions("sim")
    down.down = True
    fresh = live(down)
    assert not fresh.unloaded("sim")
    answer, took = timed(fresh, "sim")  # the failure is remembered: no read each question
    assert not answer and took < 0.1 and down.opened == 1
    down.down = False
    time.sleep(POLL_S)
    eventually(lambda: fresh.unloaded("sim"))


def test_forget_reads_now_and_an_older_read_ending_later_does_not_undo_it() -> None:
    sessions = Sessions()
    versions = live(sessions)
    assert not versions.unloaded("sim")
    # A background read begins (it sees no unload) and is slow to end...
    sessions.delays = [0.4]
    time.sleep(POLL_S)
    versions.unloaded("sim")
    # ...meanwhile this process unloads sim, and reads at once.
    sessions.models = {"sim"}
    versions.forget()
    assert versions.unloaded("sim")
    time.sleep(0.5)  # the older read has ended
    assert versions.unloaded("sim")
