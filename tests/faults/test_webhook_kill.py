"""kill -9 the Celery worker while it waits on a receiver: the webhook is still delivered.

The receiver acts on the first request (it verified it and the sender never
heard back); the delivery's lease runs out, beat dispatches it again, and the
second request carries the same webhook-id, which the receiver's
de-duplication drops. At least once, and once as far as the receiver acts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness import webclient
from harness.faults import MODEL, Stack
from harness.processes import wait_for
from tests.webhook_receiver import LOOPBACK_WEBHOOKS, Answer, Receiver, loopback_only

pytestmark = pytest.mark.faults

TIMEOUT_S = 2.0
# The lease's margin, lowered from its 30 s default: what the test waits out.
LEASE_MARGIN_S = 5.0


def test_a_celery_worker_killed_mid_attempt_still_delivers_once(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack(
        **LOOPBACK_WEBHOOKS,
        FERRY_WEBHOOK_RETRY_SCHEDULE_S="[0, 0.5, 0.5, 0.5]",
        FERRY_WEBHOOK_DISPATCH_INTERVAL_S="0.5",
        FERRY_WEBHOOK_TIMEOUT_S=str(TIMEOUT_S),
        FERRY_WEBHOOK_LEASE_MARGIN_S=str(LEASE_MARGIN_S),
    )
    stack.start("w1")
    celery_worker = stack.spawn("celery-worker", ["celery", "worker"])
    stack.spawn("celery-beat", ["celery", "beat"], supervised=True)
    client = webclient.client(
        base_url=stack.base, headers={"Authorization": f"Bearer {stack.token}"}, timeout=10
    )
    secret = client.get("/v1/webhook-secret").json()["secret"]

    script = [Answer(200, delay_s=TIMEOUT_S * 0.9), Answer(200)]
    with loopback_only() as escaped, Receiver([secret], script) as receiver:
        job = client.post(
            "/v1/jobs",
            json={"model": MODEL, "input": {"cost": 1}, "callback_url": receiver.url},
        ).json()
        receiver.wait_for(1, timeout_s=60)
        code = stack.kill(celery_worker)  # mid-attempt: the receiver is still answering
        assert code == -9
        killed_at = time.monotonic()
        stack.spawn("celery-worker-2", ["celery", "worker"])

        def delivered() -> bool:
            callback = client.get(f"/v1/jobs/{job['id']}").json()["callback"]
            return bool(callback["status"] == "delivered")

        wait_for("the redelivery", delivered, TIMEOUT_S + LEASE_MARGIN_S + 30, 0.5)
        waited_s = time.monotonic() - killed_at
        first, second = receiver.requests
    assert escaped == []

    assert first.webhook_id == second.webhook_id
    assert first.verified and second.verified
    assert len(receiver.processed) == 1  # acted on once
    # Not before the dead attempt's lease (claim + timeout + margin) ran out;
    # the kill came less than TIMEOUT_S after the claim.
    assert waited_s >= LEASE_MARGIN_S
    log = client.get(f"/v1/jobs/{job['id']}/deliveries").json()["data"][0]["attempt_log"]
    assert [a["number"] for a in log] == [1, 2]
    assert log[0]["error"].startswith("abandoned") and log[0]["duration_ms"] is None
    assert log[1]["status_code"] == 200
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded"
