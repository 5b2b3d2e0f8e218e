"""A full disk mid-run, on a small filesystem (a tmpfs the test mounts; it needs root).

Under Redis's append-only file: Redis refuses every write (``MISCONF Errors writing to the
AOF file``), reads still work. The API takes jobs as it does while Redis is down (the
database holds them, the reconciler queues them once Redis writes again); nothing
accepted is lost. Space freed, Redis writes again by itself (it retries its AOF write: no
BGREWRITEAOF, no restart) and every job completes once. That is ``appendfsync everysec``,
as Ferry runs Redis; with ``always``, Redis exits at the first AOF write that fails.

Under SQLite's database and its write-ahead log: every write fails (``database or disk is
full``). The API refuses new jobs with a 503 and a Retry-After, never a 500 or a hang; a
worker keeps the results it could not write and writes them once there is room. No
reconciler runs: a job accepted and not queued would count as lost.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import redis

from harness import webclient
from harness.accounting import Figures
from harness.faults import Stack, sim_batches, sim_jobs, tagged
from harness.processes import wait_for
from harness.submitting import Submission
from tests.conftest import missing_service

pytestmark = pytest.mark.faults

# Submissions arrive at a steady rate before, during and after the fault.
JOBS = 2000
# Submissions the SQLite scenario makes on the full disk until one is refused.
PROBES = 20
RATE_PER_S = 80
FULL_S = 5.0
SIM = {
    **sim_batches(50, 5, max_size=32),  # a batch of 32 takes about half a second
    "FERRY_VISIBILITY_TIMEOUT_S": "10",
}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``small_disk(name, size)``: a tmpfs of ``size`` mounted at ``tmp_path / name``, unmounted
    at teardown, after the stack (ask for this fixture before ``make_stack``)."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        where = tmp_path / name
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            # Root mounts it (CI runs as root): elsewhere a skip, under CI=true a failure.
            missing_service(f"a small filesystem cannot be mounted here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], check=True)


def fill(disk: Path) -> Path:
    """A file that takes every byte left on ``disk``; delete it to free them."""
    filler = disk / "filler"
    chunk = b"\0" * (1 << 16)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            os.write(fd, chunk)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


class FullDisk:
    """``disk`` filled mid-run, then waited on until the stack meets it (``met``; ``felt``
    says what is waited for): what it accepted and finished before, while the disk was full
    (:meth:`hold`) and once it was freed (:meth:`free`)."""

    def __init__(
        self,
        stack: Stack,
        submission: Submission,
        disk: Path,
        felt: str,
        met: Callable[[], bool],
        poll_s: float,
    ) -> None:
        self.stack, self.submission = stack, submission
        self.accepted_before = len(submission.ids)
        self.filler = fill(disk)
        wait_for(felt, met, 30, poll_s)
        self.full_at = time.monotonic()
        self.accepted_at_full, self.done_at_full = len(submission.ids), stack.terminal_count()
        self.accepted_while_full = self.done_while_full = self.accepted_at_free = 0
        self.freed_at = self.resumed_s = 0.0

    def hold(self, not_counted: int = 0) -> None:
        """Until ``FULL_S`` after the stack met it; then what it accepted (``not_counted``
        less) and finished meanwhile."""
        time.sleep(max(0.0, self.full_at + FULL_S - time.monotonic()))
        accepted_at_end = len(self.submission.ids) - not_counted
        self.accepted_while_full = accepted_at_end - self.accepted_at_full
        self.done_while_full = self.stack.terminal_count() - self.done_at_full

    def free(self, resumed: str, again: Callable[[], bool], poll_s: float) -> None:
        """The space freed, until the stack has ``resumed`` (``again``, which may compare
        with ``accepted_at_free``, what had been accepted when it was freed)."""
        self.filler.unlink()
        self.freed_at = time.monotonic()
        self.accepted_at_free = len(self.submission.ids)
        wait_for(resumed, again, 60, poll_s)
        self.resumed_s = time.monotonic() - self.freed_at

    def details(self, resumed_after: str) -> dict[str, Any]:
        """The figures' details of the fault; ``resumed_after`` names the seconds from the
        free until the stack resumed."""
        return {
            "full_s": round(self.freed_at - self.full_at, 1),
            resumed_after: round(self.resumed_s, 1),
            "accepted_before_fill": self.accepted_before,
            "accepted_while_full": self.accepted_while_full,
        }


Paced = Callable[[Stack, int, float], tuple[Submission, Future[None]]]


@pytest.fixture
def paced() -> Iterator[Paced]:
    """``paced(stack, count, rate)``: ``count`` sim jobs submitted at ``rate`` a second, in the
    background, each retried as a careful client does (503s and dropped connections, with
    its idempotency key); submitting stops at teardown, before the stack's."""
    stop = threading.Event()

    def submit(stack: Stack, count: int, rate: float) -> tuple[Submission, Future[None]]:
        return stack.submitter.submit_in_background(
            tagged(sim_jobs(count)), threads=4, retry_s=120, rate_per_s=rate, stop=stop
        )

    yield submit
    stop.set()


def aof_failed(stack: Stack) -> bool:
    """Redis's last write to its append-only file failed."""
    return str(stack.redis.info("persistence")["aof_last_write_status"]) == "err"


def redis_writes(stack: Stack) -> bool:
    """Redis takes writes (a PING too is refused while it cannot write its AOF)."""
    try:
        return bool(stack.redis.ping())
    except redis.RedisError:
        return False


def test_a_full_disk_under_redis_aof_loses_no_accepted_job_and_service_resumes_by_itself(
    small_disk: Callable[[str, str], Path],
    make_stack: Callable[..., Stack],
    paced: Paced,
    record: Callable[[Figures], None],
) -> None:
    # The stack's Redis (appendonly yes, appendfsync everysec, as `ferry up` runs it) keeps
    # its append-only file under redis-data.
    disk = small_disk("redis-data", "16m")
    stack = make_stack(FERRY_RECONCILE_INTERVAL_S="1", FERRY_RECONCILE_GRACE_S="2", **SIM)
    assert stack.redis.config_get("appendonly")["appendonly"] == "yes"
    assert Path(str(stack.redis.config_get("dir")["dir"])).is_relative_to(disk)
    stack.start_api()
    # The reconciler queues the jobs the API took while Redis refused writes. Celery's
    # worker cannot reach its broker meanwhile; supervised, as `ferry up` runs it.
    celery_worker = stack.spawn("celery-worker", ["celery", "worker"], supervised=True)
    beat = stack.spawn("celery-beat", ["celery", "beat"], supervised=True)
    (worker,) = stack.start_workers("w1")
    started = time.monotonic()
    submission, submitted = paced(stack, JOBS, RATE_PER_S)
    wait_for("a few hundred jobs to finish", lambda: stack.terminal_count() >= 300, 60, 0.1)

    full = FullDisk(
        stack, submission, disk, "Redis to fail its AOF write", lambda: aof_failed(stack), 0.1
    )
    # Every write refused, a PING too; reads still answered.
    with pytest.raises(redis.ResponseError, match="MISCONF Errors writing to the AOF file"):
        stack.redis.ping()
    assert stack.redis.dbsize() > 0
    time.sleep(FULL_S / 2)
    # The API stays ready (Redis's state reported): its database holds what it takes.
    ready = webclient.get(f"{stack.base}/readyz", timeout=10)
    full.hold()
    still_full = aof_failed(stack)

    full.free("Redis to write again", lambda: redis_writes(stack), 0.1)
    accepted_at_freed = len(submission.ids)
    submitted.result(timeout=180)

    accounting = stack.account("Redis AOF on a full disk", submission, started, 120, record)
    details = accounting.figures.details
    details.update(full.details("writes_again_after_s"))
    details["accepted_after_freed"] = len(submission.ids) - accepted_at_freed
    details["done_while_full"] = full.done_while_full
    details["readyz_while_full"] = (ready.status_code, ready.json()["checks"])
    details["reenqueued"] = stack.reenqueued(celery_worker)
    details["worker_retries"] = stack.count_logs(worker, "dependency error; retrying")
    try:
        stack.assert_nothing_lost(accounting)
    except AssertionError as exc:
        # The reconciler's side whole (its starts, connections, tasks), not only its errors.
        celery = stack.tail(celery_worker, 6000)
        raise AssertionError(
            f"{exc}\n---- celery-worker ----\n{celery}\n---- celery-beat ----\n"
            f"{stack.tail(beat, 3000)}"
        ) from None
    # No process died; a batch written while its acknowledgement was refused is found
    # finished when read again, not run again: nothing is computed twice.
    stack.assert_computed_once(accounting)
    assert {r.status for r in accounting.rows.values()} == {"succeeded"}, details
    assert len(submission.ids) == JOBS, details
    # The fault held until the space was freed, and was felt: Redis refused the worker's
    # reads and the reconciler queued what the API took meanwhile.
    assert still_full, details
    assert full.accepted_while_full > 0 and details["accepted_after_freed"] > 0, details
    assert details["worker_retries"] > 0, details
    assert details["reenqueued"] > 0, details
    assert ready.status_code == 200, details
    assert ready.json()["checks"]["redis"].startswith("unreachable"), details
    # Every submission got its 202 at once: none was refused or timed out.
    assert not submission.retried, details
    assert all(p.alive() and p.starts == 1 for p in [worker, stack.procs["api"]]), details
    assert beat.alive(), details


def probe(stack: Stack, submission: Submission) -> tuple[int, str, float, dict[str, Any]]:
    """Submissions while the disk is full, one at a time, until one is refused: its status,
    Retry-After, seconds and error.

    SQLite may still commit a small one in space its write-ahead log took before the disk
    filled (a failed commit's frames are written over by the next): a job it takes is
    accepted like any other, so it joins ``submission`` (under an index after the paced
    ones) and is counted with them."""
    for n in range(PROBES):
        began = time.monotonic()
        answer = webclient.post(
            f"{stack.base}/v1/jobs",
            json=tagged(sim_jobs(1))[0],
            headers={"Authorization": f"Bearer {stack.token}"},
            timeout=30,
        )
        seconds = time.monotonic() - began
        if answer.status_code != 202:
            return answer.status_code, answer.headers.get("Retry-After", ""), seconds, answer.json()
        submission.ids[JOBS + n] = answer.json()["id"]
    raise AssertionError(f"{PROBES} submissions taken on a full disk, none refused")


def test_a_full_disk_under_sqlite_refuses_new_jobs_with_503_and_loses_no_accepted_job(
    small_disk: Callable[[str, str], Path],
    make_stack: Callable[..., Stack],
    paced: Paced,
    record: Callable[[Figures], None],
) -> None:
    disk = small_disk("data", "32m")  # the stack's data directory: its database and its WAL
    stack = make_stack(url=f"sqlite:///{disk / 'ferry.db'}", FERRY_DATA_DIR=str(disk), **SIM)
    workers = stack.start("w1", "w2")
    started = time.monotonic()
    submission, submitted = paced(stack, JOBS, RATE_PER_S)
    wait_for("a few hundred jobs to finish", lambda: stack.terminal_count() >= 300, 60, 0.1)

    full = FullDisk(
        stack, submission, disk, "the API to refuse", lambda: submission.retried["503"] > 0, 0.05
    )
    refusal = probe(stack, submission)
    probes_taken = sum(1 for i in list(submission.ids) if i >= JOBS)  # list: threads add
    full.hold(not_counted=probes_taken)
    refusals_while_full = submission.retried["503"]

    full.free("a submission to be taken", lambda: len(submission.ids) > full.accepted_at_free, 0.05)
    submitted.result(timeout=180)

    accounting = stack.account("SQLite on a full disk", submission, started, 120, record)
    details = accounting.figures.details
    details.update(full.details("taken_again_after_s"))
    details["done_while_full"] = full.done_while_full
    details["refusals_while_full"] = refusals_while_full
    details["refusals"] = {
        f"{kind}, Retry-After {wait}": count
        for (kind, wait), count in submission.unavailable.items()
    }
    details["probe_while_full"] = refusal
    # Probes SQLite took all the same (counted with the paced jobs above).
    details["probes_taken"] = probes_taken
    details["worker_retries"] = retries = stack.write_retries(workers)
    stack.assert_nothing_lost(accounting)
    # No process died: a worker that cannot write keeps its batch, nothing is computed twice.
    stack.assert_computed_once(accounting)
    assert {r.status for r in accounting.rows.values()} == {"succeeded"}, details
    assert sorted(i for i in submission.ids if i < JOBS) == list(range(JOBS)), details
    # Refused at once, with a 503 that says when to come back (never a 500, never a hang).
    status, retry_after, seconds, body = refusal
    assert (status, retry_after) == (503, "2"), details
    assert body["error"]["type"] == "unavailable", details
    assert seconds < 5, details
    assert set(submission.retried) == {"503"}, details
    assert set(submission.unavailable) == {("unavailable", "2")}, details
    assert any(retries.values()), details
    assert all(p.alive() and p.starts == 1 for p in [*workers, stack.procs["api"]]), details
