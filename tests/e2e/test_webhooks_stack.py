"""Webhooks through `ferry up`: the worker, Celery, beat and a real receiver.

(Expired and cancelled outcomes are delivered by the same path; their tests
are in tests/integration/test_webhooks.py, where timing can be controlled.)

The stack runs with a compressed retry schedule and 127.0.0.1 allowed. Every
process of the stack loads a network guard (``netguard/sitecustomize.py``)
that refuses, and logs, any connection beyond loopback; the test process runs
under the same guard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import webclient
from harness.stack import FerryUp
from tests.webhook_receiver import Answer, Receiver, loopback_only

pytestmark = pytest.mark.e2e

GUARD_DIR = Path(__file__).parent / "netguard"
SCHEDULE_S = "[0, 0.5, 0.5, 0.5]"


class Stack(FerryUp):
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        response = webclient.post(
            f"{self.base}/v1/jobs", json=body, headers=self.headers(), timeout=30
        )
        assert response.status_code == 202, response.text
        return dict(response.json())

    def job(self, job_id: str) -> dict[str, Any]:
        response = webclient.get(
            f"{self.base}/v1/jobs/{job_id}", headers=self.headers(), timeout=30
        )
        return dict(response.json())

    def wait_for_callback(self, job_id: str, statuses: set[str]) -> dict[str, Any]:
        until = time.monotonic() + 60
        while True:
            job = self.job(job_id)
            if job["callback"] and job["callback"]["status"] in statuses:
                return job
            if time.monotonic() > until:
                deliveries = webclient.get(
                    f"{self.base}/v1/jobs/{job_id}/deliveries", headers=self.headers(), timeout=10
                ).json()
                raise AssertionError(f"{job['callback']}\n{deliveries}")
            assert self.process is not None and self.process.poll() is None, "".join(self.output)
            time.sleep(0.2)

    @property
    def guard_log(self) -> Path:
        return Path(self.env["FERRY_TEST_NETGUARD_LOG"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("webhook-stack")
    stack = Stack(
        root,
        FERRY_MODELS="sim",
        FERRY_FLOWER_PORT="0",  # no Flower: nothing here looks at it (test_flower.py does)
        FERRY_SIM_LATENCY_BASE_MS="5",
        FERRY_WEBHOOK_ALLOW_HTTP="true",
        FERRY_WEBHOOK_ALLOWED_NETWORKS='["127.0.0.0/8"]',
        FERRY_WEBHOOK_RETRY_SCHEDULE_S=SCHEDULE_S,
        FERRY_WEBHOOK_RETRY_JITTER="0",
        FERRY_WEBHOOK_DISPATCH_INTERVAL_S="0.3",
        FERRY_WEBHOOK_TIMEOUT_S="2",
        FERRY_TEST_NETGUARD_LOG=str(root / "netguard.log"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(GUARD_DIR), os.environ.get("PYTHONPATH")])),
    )
    with stack.running(timeout_s=180):
        yield stack


def test_outcomes_reach_a_real_receiver_through_celery_and_beat(stack: Stack) -> None:
    secret = webclient.get(
        f"{stack.base}/v1/webhook-secret", headers=stack.headers(), timeout=10
    ).json()["secret"]
    flaky = [Answer(500), Answer(500), Answer(500), Answer(200)]
    with (
        loopback_only() as escaped,
        Receiver([secret], flaky) as retried,
        Receiver([secret]) as steady,
        Receiver([secret], [Answer(410)]) as gone,
    ):
        ok = stack.submit({"model": "sim", "input": {"cost": 2}, "callback_url": retried.url})
        failed = stack.submit(
            {"model": "sim", "input": {"cost": 1, "fail": True}, "callback_url": steady.url}
        )
        refused = stack.submit({"model": "sim", "input": {"cost": 1}, "callback_url": gone.url})

        done = stack.wait_for_callback(ok["id"], {"delivered", "failed"})
        assert done["status"] == "succeeded"
        assert done["callback"]["status"] == "delivered", done["callback"]
        assert done["callback"]["attempts"] == 4
        requests = retried.wait_for(4)
        assert [r.status for r in requests] == [500, 500, 500, 200]
        assert len({r.webhook_id for r in requests}) == 1
        assert all(r.verified for r in requests)
        assert len(retried.processed) == 1
        assert retried.processed[0]["data"]["output"] == done["output"]

        stack.wait_for_callback(failed["id"], {"delivered"})
        (request,) = steady.wait_for(1)
        assert request.body["type"] == "job.failed"
        assert request.body["data"]["error"] == stack.job(failed["id"])["error"]

        gone_job = stack.wait_for_callback(refused["id"], {"failed"})
        assert gone_job["callback"]["last_status_code"] == 410
        assert len(gone.requests) == 1
        assert escaped == []

    deliveries = webclient.get(
        f"{stack.base}/v1/jobs/{ok['id']}/deliveries", headers=stack.headers(), timeout=10
    ).json()["data"]
    assert [a["status_code"] for a in deliveries[0]["attempt_log"]] == [500, 500, 500, 200]
    assert blocked_but_the_probe(stack) == [], stack.guard_log.read_text()


def test_a_receiver_down_for_the_whole_schedule_leaves_the_job_alone(stack: Stack) -> None:
    with Receiver([]) as closed:
        url = closed.url  # nothing listens there once the block ends
    job = stack.submit({"model": "sim", "input": {"cost": 1}, "callback_url": url})
    done = stack.wait_for_callback(job["id"], {"failed", "delivered"})
    assert done["status"] == "succeeded"
    assert done["callback"]["status"] == "failed"
    assert done["callback"]["attempts"] == 4
    assert done["callback"]["last_error"].startswith("connection failed")
    assert blocked_but_the_probe(stack) == [], stack.guard_log.read_text()


# The public address the guard's own test sends a webhook to: its refusals (retried
# while the other tests run, in whatever order) are the only ones the log may hold.
PROBE = "93.184.216.34"


def blocked_but_the_probe(stack: Stack) -> list[str]:
    """The addresses the network guard refused, other than the probe's."""
    if not stack.guard_log.exists():
        return []
    lines = stack.guard_log.read_text().splitlines()
    return [line for line in lines if line.split()[-1] != PROBE]


def test_the_network_guard_is_live_in_the_stack(stack: Stack) -> None:
    """Without a live guard the other checks would prove nothing: a public address
    passes Ferry's SSRF check, so its delivery reaches the Celery worker's connect,
    where the guard stops it (and logs it) before any packet is sent."""
    job = stack.submit(
        {"model": "sim", "input": {"cost": 1}, "callback_url": f"https://{PROBE}/hook"}
    )
    done = stack.wait_for_callback(job["id"], {"retrying", "failed"})
    assert f"network guard: {PROBE} is not loopback" in done["callback"]["last_error"]
    assert stack.guard_log.read_text().split()[-1] == PROBE
