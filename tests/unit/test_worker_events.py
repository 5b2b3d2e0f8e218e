"""The batch observers: each hears every event, and one that raises cannot silence the rest."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from core.streams.protocol import JobMessage
from workers.gpu.events import BatchObserver, JobDone, KickDeliveries, Observers


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
