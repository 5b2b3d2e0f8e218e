"""The batch observers: each hears every event, and one that raises cannot silence the rest."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import cast

import pytest

from core.streams.protocol import JobMessage
from scheduler import BatchDecision
from workers.gpu.device import InFlight
from workers.gpu.events import BatchObserver, JobDone, KickDeliveries, Observers
from workers.gpu.recorder import Claimed


class Broken(BatchObserver):
    def jobs_finished(self, done: Sequence[JobDone], batch_id: str | None, at_s: float) -> None:
        raise RuntimeError("a sink that is down")

    def deliveries_created(self, delivery_ids: Sequence[str]) -> None:
        raise RuntimeError("a sink that is down")


class Heard(BatchObserver):
    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []

    def jobs_finished(self, done: Sequence[JobDone], batch_id: str | None, at_s: float) -> None:
        self.done += [(d.job.job_id, d.status) for d in done]


def test_a_failing_observer_is_logged_and_the_next_still_hears(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard = Heard()
    kicked: list[list[str]] = []
    observers = Observers(Broken(), heard, KickDeliveries(kicked.append))
    job = JobMessage(job_id="j1", lane="normal", cost=1, enqueued_at_ms=0)
    with caplog.at_level(logging.ERROR, logger="workers.gpu.events"):
        observers.jobs_finished([JobDone(job, "succeeded")], "b1", 1.0)
        observers.deliveries_created(["d1", "d2"])
    assert heard.done == [("j1", "succeeded")]
    assert kicked == [["d1", "d2"]]
    failures = [r for r in caplog.records if r.getMessage() == "a batch observer failed"]
    assert [(r.observer, r.hook) for r in failures] == [  # type: ignore[attr-defined]
        ("Broken", "jobs_finished"),
        ("Broken", "deliveries_created"),
    ]


class Failures(BatchObserver):
    def __init__(self) -> None:
        self.failed: list[tuple[str, float, int, str]] = []

    def batch_failed(self, batch_id: str, runtime_s: float, size: int, error: str) -> None:
        self.failed.append((batch_id, runtime_s, size, error))


def test_a_batch_that_broke_off_is_reported_with_its_size_time_and_what_raised() -> None:
    heard = Failures()
    flight = InFlight(
        batch_id="b7",
        entries=[],
        claimed=[cast(Claimed, object())] * 3,
        costs=[1, 1, 1],
        written=[],
        decision=cast(BatchDecision, None),
        started=time.perf_counter() - 0.25,
    )
    flight.report_failed(Observers(heard), MemoryError("the device's"))
    [(batch_id, runtime_s, size, error)] = heard.failed
    assert (batch_id, size) == ("b7", 3)
    assert 0.25 <= runtime_s < 60
    assert error == "MemoryError while running or recording it (jobs not acknowledged run again)"
