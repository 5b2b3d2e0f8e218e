"""What the API answers while its database server is down: 503 with Retry-After, never a 500."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import httpx

from harness import webclient
from harness.faults import MODEL, Stack, sim_jobs
from harness.processes import wait_for


def assert_unavailable(stack: Stack, job_id: str) -> dict[str, Any]:
    """A submission, a read of ``job_id`` and /readyz, each refused as the API promises while
    the database is unreachable; what each answered.

    The submission carries no tag: with the database down nothing can store it, and
    an untagged row or computation would be counted against the scenario.
    """
    seen: dict[str, Any] = {}
    with webclient.client(
        base_url=stack.base, headers={"Authorization": f"Bearer {stack.token}"}, timeout=30
    ) as client:
        submitted = client.post("/v1/jobs", json={"model": MODEL, "input": {"cost": 1}})
        seen["submit"] = (submitted.status_code, submitted.headers.get("Retry-After"))
        assert submitted.status_code == 503, submitted.text
        assert submitted.headers.get("Retry-After") == "2", submitted.headers
        assert submitted.json()["error"]["type"] == "unavailable", submitted.text

        read = client.get(f"/v1/jobs/{job_id}")
        seen["read"] = (read.status_code, read.headers.get("Retry-After"))
        assert read.status_code == 503, read.text
        assert read.headers.get("Retry-After") == "2", read.headers

        ready = client.get("/readyz")
        seen["readyz"] = (ready.status_code, ready.json()["checks"]["database"])
        assert ready.status_code == 503, ready.text
        assert ready.headers.get("Retry-After") == "5", ready.headers
        assert ready.json()["checks"]["database"].startswith("unreachable"), ready.text
    return seen


def wait_ready(stack: Stack, timeout_s: float = 60) -> None:
    """Until the API answers /readyz with 200 again (its database is back)."""

    def ready() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return webclient.get(f"{stack.base}/readyz", timeout=5).status_code == 200
        return False

    wait_for("the API to be ready again", ready, timeout_s, 0.2)


# Submissions arrive at this steady rate, from before the fault until after recovery,
# when the scenario stops them: still arriving at the fault whatever the machine's speed,
# so clients are turned away and retry. (All at once, a fast machine had sent a fixed
# number before the fault: once in CI, every one.)
RATE_PER_S = 150.0
# More than are ever sent: the scenario stops them first.
MOST_JOBS = 20_000


class SteadySubmissions:
    """Jobs submitted at ``RATE_PER_S`` in the background until :meth:`stop`."""

    def __init__(self, stack: Stack) -> None:
        self.halt = threading.Event()
        self.submission, self.submitted = stack.submit_in_background(
            sim_jobs(MOST_JOBS), rate_per_s=RATE_PER_S, stop=self.halt
        )

    def stop_once_accepted_again(self, more: int = 100) -> None:
        """Once ``more`` jobs are accepted after the fault, send no more; wait for the last."""
        back = len(self.submission.ids)
        wait_for("submissions accepted again", lambda: len(self.submission.ids) >= back + more, 60)
        self.halt.set()
        self.submitted.result(timeout=120)
