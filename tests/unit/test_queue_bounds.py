"""A model's queue bounds: what does not fit, and the Retry-After its drain rate gives."""

from __future__ import annotations

import math

import pytest

from api.jobs.submissions import QueueView
from core.models.estimates import ModelEstimate
from core.streams.bounds import (
    MAX_RETRY_AFTER_S,
    UNKNOWN_RATE_RETRY_AFTER_S,
    Excess,
    QueueBound,
    retry_after_s,
)


@pytest.mark.parametrize(
    ("bound", "jobs", "queued_bytes", "input_bytes", "expected"),
    [
        (QueueBound(), 10**9, 10**12, 10**6, None),  # no bound
        (QueueBound(max_jobs=100), 99, 0, 10, None),  # the last place
        (QueueBound(max_jobs=100), 100, 0, 10, Excess("FERRY_QUEUE_MAX_JOBS", 100, 100, 1)),
        (QueueBound(max_jobs=100), 130, 0, 10, Excess("FERRY_QUEUE_MAX_JOBS", 100, 130, 31)),
        (QueueBound(max_bytes=1000), 9, 900, 100, None),  # exactly full
        # 50 bytes over, at 100 bytes a queued job: one must finish.
        (QueueBound(max_bytes=1000), 10, 1000, 50, Excess("FERRY_QUEUE_MAX_BYTES", 1000, 1000, 1)),
        # 350 bytes over, at 100 a job: four must finish.
        (QueueBound(max_bytes=1000), 10, 1000, 350, Excess("FERRY_QUEUE_MAX_BYTES", 1000, 1000, 4)),
        # Never more than the queue holds.
        (QueueBound(max_bytes=1000), 2, 990, 1000, Excess("FERRY_QUEUE_MAX_BYTES", 1000, 990, 2)),
        # An empty queue holds no bytes, whatever the counter says.
        (QueueBound(max_bytes=1000), 0, 5000, 10, None),
        # The job bound is said first when both are passed.
        (QueueBound(10, 1000), 10, 5000, 10, Excess("FERRY_QUEUE_MAX_JOBS", 10, 10, 1)),
    ],
)
def test_what_does_not_fit(
    bound: QueueBound, jobs: int, queued_bytes: int, input_bytes: int, expected: Excess | None
) -> None:
    assert bound.excess(jobs, queued_bytes, input_bytes) == expected


def test_an_input_larger_than_the_whole_byte_bound_never_fits() -> None:
    assert QueueBound(max_bytes=1000).never_fits(1001)
    assert not QueueBound(max_bytes=1000).never_fits(1000)
    assert not QueueBound().never_fits(10**12)


@pytest.mark.parametrize(
    ("drain_s", "expected"),
    [
        (None, UNKNOWN_RATE_RETRY_AFTER_S),  # no rate learned yet
        (math.inf, UNKNOWN_RATE_RETRY_AFTER_S),
        (0.0, 1),  # at least a second
        (0.2, 1),
        (1.0, 1),
        (1.01, 2),  # rounded up: a client back on time finds room
        (41.5, 42),
        (10**6, MAX_RETRY_AFTER_S),
    ],
)
def test_retry_after_is_the_drain_time_in_whole_seconds(
    drain_s: float | None, expected: int
) -> None:
    assert retry_after_s(drain_s) == expected


# 10 jobs a batch of 100 ms, back to back: 100 jobs a second per worker.
EST = ModelEstimate(
    latency_a_s=0.1, latency_b_s=0.0, padded=False, max_batch_size=10,
    max_batch_cost=math.inf, mean_cost=1.0,
)  # fmt: skip


def view(workers: int, estimate: ModelEstimate | None = EST) -> QueueView:
    return QueueView(estimate, {"normal": {"t": 1000}}, workers)


def test_the_drain_time_follows_the_learned_rate_and_the_live_workers() -> None:
    one = view(1).drain_s(500)
    assert one == pytest.approx(499 / 10 * 0.1 + 0.1)  # the batches ahead, then its own
    assert view(2).drain_s(500) == pytest.approx(499 / 10 * 0.1 / 2 + 0.1)
    # No worker live: as if one were (the first to come back drains it).
    assert view(0).drain_s(500) == one
    assert retry_after_s(one) == 6
    # A slower model: ten times the latency, ten times the wait.
    slow = QueueView(ModelEstimate(1.0, 0.0, False, 10, math.inf, 1.0), {"normal": {"t": 1000}}, 1)
    assert retry_after_s(slow.drain_s(500)) == 51


def test_nothing_learned_no_drain_time() -> None:
    assert view(1, estimate=None).drain_s(500) is None


def test_a_view_counts_the_jobs_and_bytes_this_process_adds() -> None:
    queue = QueueView(None, {"urgent": {}, "vip": {}, "normal": {"a": 3}, "bulk": {"": 2}}, 0)
    assert queue.jobs == 5
    queue.add("normal", "b", 120)
    queue.add("urgent", "a", 30)
    assert (queue.jobs, queue.queued_bytes) == (7, 150)


def test_urgent_and_vip_jobs_may_fill_a_tenth_more_than_the_bound() -> None:
    bound = QueueBound(max_jobs=300, max_bytes=1000)
    assert bound.for_lane("normal") is bound and bound.for_lane("bulk") is bound
    assert bound.for_lane("urgent") == QueueBound(330, 1100) == bound.for_lane("vip")
    assert bound.excess(300, 0, 1) is not None
    assert bound.for_lane("urgent").excess(300, 0, 1) is None
    assert bound.for_lane("urgent").excess(330, 0, 1) is not None
    assert QueueBound(5, 0).for_lane("urgent") == QueueBound(6, 0)  # one more at least
    assert QueueBound().for_lane("urgent") == QueueBound()  # no bound stays none
