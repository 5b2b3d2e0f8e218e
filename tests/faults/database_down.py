"""The database scenarios' shared parts: the stack they break, its run up to the fault, and
what the API answers while its database is down (503 with Retry-After, never a 500)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from harness import webclient
from harness.faults import MODEL, Stack, sim_jobs
from harness.processes import Proc, wait_for


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


# The stack each database scenario breaks: batches of 32 that take about half a second
# each, a visibility timeout short enough for a lost batch to come back within the
# scenario, and the reconciler every second.
DATABASE_FAULT_ENV = {
    "FERRY_SIM_LATENCY_BASE_MS": "50",
    "FERRY_SIM_LATENCY_PER_COST_MS": "5",
    "FERRY_BATCH_MAX_SIZE": "32",
    "FERRY_VISIBILITY_TIMEOUT_S": "10",
    "FERRY_RECONCILE_INTERVAL_S": "1",
    "FERRY_RECONCILE_GRACE_S": "2",
}


@dataclass
class Busy:
    """A stack mid-run, the moment before its database fails."""

    steady: SteadySubmissions
    workers: list[Proc]
    celery_worker: Proc
    started: float  # monotonic: when the submissions began
    done_before: int  # jobs terminal at the fault
    still_submitting: bool  # the submissions had not ended at the fault


def run_up_to_the_fault(stack: Stack, backlog: int) -> Busy:
    """The API, and Celery's worker and beat: a commit whose answer the fault cut off is
    answered 503, and the client's retry then gets the job back (idempotency key)
    although it was never queued; the reconciler queues it. Then steady submissions, a
    backlog of ``backlog`` first so that both workers are busy when the fault strikes, the
    two workers, and a couple of hundred jobs finished."""
    stack.start_api()
    celery_worker = stack.spawn("celery-worker", ["celery", "worker"], supervised=True)
    stack.spawn("celery-beat", ["celery", "beat"], supervised=True)
    started = time.monotonic()
    steady = SteadySubmissions(stack)
    wait_for("a backlog", lambda: len(steady.submission.ids) >= backlog, 60)
    workers = stack.start_workers("w1", "w2")
    wait_for("a couple of hundred jobs to finish", lambda: stack.terminal_count() >= 200, 60, 0.1)
    return Busy(
        steady=steady,
        workers=workers,
        celery_worker=celery_worker,
        started=started,
        done_before=stack.terminal_count(),
        still_submitting=not steady.submitted.done(),
    )
