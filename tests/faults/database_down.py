"""The database scenarios' shared parts: the stack they break, its run up to the fault,
what the API answers while its database is down (503 with Retry-After, never a 500), and
what a database server stopped and brought back must leave."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from harness import webclient
from harness.accounting import Figures
from harness.faults import MODEL, Stack, sim_batches, sim_jobs
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
    **sim_batches(50, 5, max_size=32),
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


class ServerOutage:
    """The database server stopped (``stop`` returns once it is down) mid-run: the API refuses
    as it promises (``assert_unavailable``) until a server that takes writes is back
    (:meth:`restore`)."""

    def __init__(self, stack: Stack, busy: Busy, stop: Callable[[], None]) -> None:
        self.stack, self.busy = stack, busy
        self.stopped_at = time.monotonic()
        stop()
        self.answers = assert_unavailable(stack, busy.steady.submission.accepted[0])
        self.seconds = 0.0

    def restore(self, start: Callable[[], None], after_s: float) -> None:
        """``start`` a server that takes writes ``after_s`` after the stop; then wait until
        the API is ready and has taken jobs again, and send no more."""
        time.sleep(max(0.0, after_s - (time.monotonic() - self.stopped_at)))
        start()
        self.seconds = time.monotonic() - self.stopped_at
        wait_ready(self.stack)
        self.busy.steady.stop_once_accepted_again()

    def assert_waited_out(
        self, scenario: str, record: Callable[[Figures], None], moment: str, length: str
    ) -> dict[str, Any]:
        """Count the scenario and assert what the outage must leave: nothing lost, and no
        process died (a worker that waits for the database keeps its batch, so nothing is
        computed twice); it was felt too, as clients turned away while it lasted. The
        figures' details, which name the stop ``moment`` (``done_before_<moment>``) and the
        seconds until the restore ``length``."""
        stack, busy = self.stack, self.busy
        submission, workers = busy.steady.submission, busy.workers
        accounting = stack.account(scenario, submission, busy.started, 120, record)
        details = accounting.figures.details
        details[length] = round(self.seconds, 1)
        details[f"done_before_{moment}"] = busy.done_before
        details[f"submitting_at_{moment}"] = busy.still_submitting
        details["answers_while_down"] = self.answers
        details["reenqueued"] = stack.reenqueued(busy.celery_worker)
        details["worker_retries"] = stack.write_retries(workers)
        stack.assert_nothing_lost(accounting)
        stack.assert_computed_once(accounting)
        assert {r.status for r in accounting.rows.values()} == {"succeeded"}, details
        assert all(worker.alive() and worker.starts == 1 for worker in workers), details
        assert stack.procs["api"].alive()
        assert busy.still_submitting and details["retried"], details
        return details
