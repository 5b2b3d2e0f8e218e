"""A Celery worker's host clock six minutes ahead, then back: its webhook deliveries are
signed and scheduled by the Redis server's clock, so receivers take them, and the retries
beat dispatches are delivered while its clock is ahead (beat's ticks expire after a quarter
of an hour, not a second, which such a worker found passed and discarded)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import webclient
from harness.clock_step import SteppedClock, library, logged_times
from harness.faults import MODEL, Stack
from harness.processes import wait_for
from tests.conftest import missing_service
from tests.webhook_receiver import LOOPBACK_WEBHOOKS, Answer, Receiver, loopback_only

pytestmark = pytest.mark.faults

# Past the 5 minutes of webhook-timestamp a receiver takes (Standard Webhooks' tolerance).
AHEAD_S = 360
RETRY_S = 0.5  # the retry schedule's delay after the first attempt
# How long the retry is given while the clock is ahead: it comes within a second or two,
# and within seconds on a machine busy enough to take seconds over each dispatch; without
# the fix it never comes (every dispatch discarded as expired, or signed 6 minutes ahead).
AHEAD_FOR_S = 60.0
DISCARDED = "Discarding revoked task: ferry.webhooks.dispatch"
DISPATCHED = "Task ferry.webhooks.dispatch["


def test_a_celery_worker_clock_ahead_signs_deliveries_receivers_accept(
    make_stack: Callable[..., Stack], tmp_path: Path
) -> None:
    # The dev extra installs it: missing, a skip outside CI and a failure under CI=true.
    so = library() or missing_service("libfaketime is not installed (the dev extra's wheel)")
    clock = SteppedClock(tmp_path / "clock", so)
    clock.step(AHEAD_S)
    stack = make_stack(
        **LOOPBACK_WEBHOOKS,
        FERRY_WEBHOOK_RETRY_SCHEDULE_S=f"[0, {RETRY_S}, {RETRY_S}, {RETRY_S}]",
        FERRY_WEBHOOK_DISPATCH_INTERVAL_S="0.5",
    )
    stack.start("w1")
    # The only Celery worker, its clock six minutes ahead; beat's and the sim worker's true.
    celery_worker = stack.spawn("celery-worker", ["celery", "worker"], False, **clock.env())
    stack.spawn("celery-beat", ["celery", "beat"], supervised=True)

    def dispatched() -> bool:
        return any(
            str(line.get("msg", "")).startswith(DISPATCHED) and "succeeded" in line["msg"]
            for line in stack.log_lines(celery_worker)
        )

    # Beat ticking and its dispatches run on the worker ahead before the job goes in, so
    # that the time the retry is given is not spent starting beat on a busy machine.
    wait_for("a dispatch run on the worker ahead", dispatched, 90, 0.25)
    client = webclient.client(
        base_url=stack.base, headers={"Authorization": f"Bearer {stack.token}"}, timeout=10
    )
    secret = client.get("/v1/webhook-secret").json()["secret"]

    def callback() -> dict[str, str]:
        found: dict[str, str] = client.get(f"/v1/jobs/{job['id']}").json()["callback"]
        return found

    # The first attempt is answered 500, so that the second is the retry schedule's.
    with loopback_only() as escaped, Receiver([secret], [Answer(500), Answer(200)]) as receiver:
        job = client.post(
            "/v1/jobs",
            json={"model": MODEL, "input": {"cost": 1}, "callback_url": receiver.url},
        ).json()
        # The first attempt: the sim worker kicks its task (no expiry) when the job ends.
        receiver.wait_for(1, timeout_s=60)
        wait_for("the first attempt recorded", lambda: callback()["status"] == "retrying", 10, 0.1)
        retry_due = dt.datetime.fromisoformat(callback()["next_attempt_at"])
        true_now = dt.datetime.now(dt.UTC)
        until = time.monotonic() + AHEAD_FOR_S
        while time.monotonic() < until and callback()["status"] != "delivered":
            time.sleep(0.25)
        delivered_while_ahead = callback()["status"] == "delivered"
        discarded = sum(
            1
            for line in stack.log_lines(celery_worker)
            if str(line.get("msg", "")).startswith(DISCARDED)
        )
        clock.step(0)
        back_at = time.monotonic()
        wait_for("the retry, delivered", lambda: callback()["status"] == "delivered", 20, 0.25)
        delivered_after_s = time.monotonic() - back_at
        requests = list(receiver.requests)
    assert escaped == []
    skews = [round(r.timestamp - r.received_at, 1) for r in requests]
    ahead = [t for t in logged_times(celery_worker) if t > true_now + dt.timedelta(seconds=300)]
    context = dict(
        skews=skews,
        callback=callback(),
        retry_due_in_s=(retry_due - true_now).total_seconds(),
        delivered_while_ahead=delivered_while_ahead,
        dispatches_discarded=discarded,
        delivered_after_clock_back_s=round(delivered_after_s, 1),
        logged_ahead=len(ahead),
    )
    # The fault: the Celery worker's own log is stamped six minutes ahead.
    assert ahead, context
    # Signed by the Redis server's clock: the receiver took both attempts (before, the
    # webhook-timestamp was 6 minutes ahead and each attempt got a 401).
    assert len(requests) == 2 and all(r.verified for r in requests), context
    assert requests[0].webhook_id == requests[1].webhook_id, context
    assert all(abs(skew) < 5 for skew in skews), context
    # Scheduled by it too: due RETRY_S after the attempt, not AHEAD_S later.
    assert (retry_due - true_now).total_seconds() < 5, context
    assert callback()["attempts"] == 2, context
    assert celery_worker.alive() and celery_worker.starts == 1
    # Beat's dispatches ran on the worker ahead: none discarded as expired, the retry
    # delivered while its clock was still six minutes ahead.
    assert discarded == 0 and delivered_while_ahead, context
