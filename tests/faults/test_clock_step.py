"""A worker host's clock stepped five minutes ahead mid-run, back, five minutes behind, and
back: no job with a deadline it can meet expires, nothing is lost or run twice, no lease is
taken over, the heartbeats stay true and so do the times recorded."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from sqlalchemy import select

from core.db.schema import Job
from core.streams.protocol import workers_key
from core.streams.queues import live_workers
from harness.accounting import Figures
from harness.clock_step import SteppedClock, library, logged_times
from harness.faults import MODEL, Stack, sim_batches, sim_jobs, tagged
from harness.processes import wait_for
from harness.submitting import Submission
from tests.conftest import missing_service
from workers.gpu.executions import read_executions

pytestmark = pytest.mark.faults

JOBS = 1000
RATE_PER_S = 45.0
DEADLINE_MS = 120_000  # every other job's: generous, met with ease unless a clock lies
STEP_S = 300
# The stepped worker's clock, in turn: this far off the true time (s), for this long (s).
PHASES = ((STEP_S, 4.0), (0, 2.0), (-STEP_S, 4.0), (0, 0.0))
# What a recorded time may be off by without a clock to blame (the API's commit and the
# worker's claim are separate processes on one host).
SLACK_S = 2.0


def bodies() -> list[dict[str, Any]]:
    jobs = sim_jobs(JOBS)
    for i, body in enumerate(jobs):
        if i % 2 == 0:
            body["deadline_ms"] = DEADLINE_MS
    return tagged(jobs)


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    """Set at teardown, before the stack's: the paced submitting and the sampling end."""
    event = threading.Event()
    yield event
    event.set()


def paced(stack: Stack, stop: threading.Event) -> tuple[Submission, Future[None]]:
    """The jobs submitted at RATE_PER_S, in the background, each retried as a careful client."""
    return stack.submitter.submit_in_background(
        bodies(), threads=4, retry_s=60, rate_per_s=RATE_PER_S, stop=stop
    )


class Presence:
    """Samples, every 0.1 s, the workers' heartbeats as the API counts them."""

    def __init__(self, stack: Stack, stop: threading.Event) -> None:
        self.stack = stack
        self.stop = stop
        self.samples: list[tuple[float, dict[str, float], int]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        key = workers_key(self.stack.prefix, MODEL)
        while not self.stop.wait(0.1):
            try:
                found: Any = self.stack.redis.zrange(key, 0, -1, withscores=True)
                beats = {str(name): float(score) for name, score in found}
                live = live_workers(self.stack.redis, self.stack.prefix, MODEL)
            except Exception:
                continue
            self.samples.append((time.time(), beats, live))

    def ahead_s(self, name: str) -> float:
        """How far ahead of the harness's clock ``name``'s heartbeat went, at most."""
        return max((b[name] - at for at, b, _ in self.samples if name in b), default=0.0)

    def behind_s(self, name: str) -> float:
        """How far behind the harness's clock ``name``'s heartbeat fell, at most."""
        return max((at - b[name] for at, b, _ in self.samples if name in b), default=0.0)

    def missing(self, name: str) -> int:
        return sum(1 for _, b, _ in self.samples if name not in b)

    def fewest_live(self) -> int:
        return min((live for _, _, live in self.samples), default=0)


def created_and_deadlines(
    stack: Stack, ids: list[str]
) -> tuple[dict[str, dt.datetime], dict[str, dt.datetime | None]]:
    """Each job's created_at (the API's clock) and deadline_at."""
    created: dict[str, dt.datetime] = {}
    deadlines: dict[str, dt.datetime | None] = {}
    with stack.engine.connect() as conn:
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            query = select(Job.id, Job.created_at, Job.deadline_at).where(Job.id.in_(chunk))
            for job_id, created_at, deadline_at in conn.execute(query):
                created[job_id], deadlines[job_id] = created_at, deadline_at
    return created, deadlines


def test_a_worker_clock_stepped_ahead_and_back_expires_no_meetable_deadline(
    make_stack: Callable[..., Stack],
    record: Callable[[Figures], None],
    stop: threading.Event,
    tmp_path: Any,
) -> None:
    # The dev extra installs it: missing, a skip outside CI and a failure under CI=true.
    so = library() or missing_service("libfaketime is not installed (the dev extra's wheel)")
    clock = SteppedClock(tmp_path / "clock", so)
    stack = make_stack(
        FERRY_VISIBILITY_TIMEOUT_S="5",
        # A batch of up to 8 takes 100 ms + 5 ms per unit of cost: about 40 jobs a second
        # a worker, so that both are busy and the stepped one claims its share.
        **sim_batches(100, 5, max_size=8),
    )
    stack.start_api(wait=False)
    steady = stack.start_worker("w1", wait=False)
    stepped = stack.start_worker("w2", wait=False, env=clock.env())
    stack.wait_worker(steady)
    stack.wait_worker(stepped)
    stack.wait_api(stack.procs["api"])
    presence = Presence(stack, stop)
    presence.thread.start()

    began = dt.datetime.now(dt.UTC)
    started = time.monotonic()
    submission, submitted = paced(stack, stop)
    wait_for("a few hundred jobs to finish", lambda: stack.terminal_count() >= 200, 60, 0.1)
    windows: list[tuple[dt.datetime, dt.datetime]] = []  # when the clock was off, truly
    for offset_s, for_s in PHASES:
        clock.step(offset_s)
        at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=clock.LAG_S)  # by then, surely
        time.sleep(for_s)
        if offset_s:
            windows.append((at, dt.datetime.now(dt.UTC)))
    submitted.result(timeout=90)

    accounting = stack.account("worker clock stepped", submission, started, 60, record)
    ended = dt.datetime.now(dt.UTC)
    rows = accounting.rows
    details = accounting.figures.details
    ran_by: dict[str, str] = {}
    for execution in read_executions(stack.execution_dir):
        for job_id, _attempt in execution.jobs:
            ran_by[job_id] = execution.worker
    created, deadlines = created_and_deadlines(stack, list(rows))
    expired = [job_id for job_id, row in rows.items() if row.status == "expired"]
    # Claimed by the stepped worker while its clock was off (by the true time).
    claimed_stepped = [
        job_id
        for job_id, row in rows.items()
        if ran_by.get(job_id) == stepped.name
        and row.started_at is not None
        and any(a <= row.started_at <= b for a, b in windows)
    ]
    # The times written: every job started after it was created and finished after it
    # started, within the run, by the API's clock and the worker's, give or take SLACK_S.
    slack = dt.timedelta(seconds=SLACK_S)
    times_off = [
        job_id
        for job_id, row in rows.items()
        if row.started_at is None
        or row.finished_at is None
        or not (created[job_id] - slack <= row.started_at <= row.finished_at <= ended + slack)
    ]
    # The fault itself, seen in the stepped worker's own log: lines stamped minutes after
    # the run ended (ahead), and minutes before it began (behind).
    logged = logged_times(stepped)
    reclaims = sum(
        stack.count_logs(p, "reclaimed entries another worker left unacknowledged")
        for p in (steady, stepped)
    )
    details.update(
        step_s=STEP_S,
        phases=PHASES,
        with_deadline=sum(1 for d in deadlines.values() if d is not None),
        expired=len(expired),
        expired_errors=sorted({rows[j].error or "" for j in expired}),
        times_off=len(times_off),
        run_by_stepped=sum(1 for w in ran_by.values() if w == stepped.name),
        run_by_steady=sum(1 for w in ran_by.values() if w == steady.name),
        claimed_while_stepped=len(claimed_stepped),
        with_deadline_claimed_while_stepped=sum(
            1 for j in claimed_stepped if deadlines[j] is not None
        ),
        logged_ahead=sum(1 for t in logged if t > ended + dt.timedelta(seconds=60)),
        logged_behind=sum(1 for t in logged if t < began - dt.timedelta(seconds=60)),
        heartbeat_ahead_s=round(presence.ahead_s(stepped.name), 1),
        heartbeat_behind_s=round(presence.behind_s(stepped.name), 1),
        steady_heartbeat_missing=presence.missing(steady.name),
        fewest_live_workers=presence.fewest_live(),
        reclaims=reclaims,
    )
    stack.assert_nothing_lost(accounting)
    stack.assert_computed_once(accounting)
    # The clock was stepped, both ways, while the stepped worker ran.
    assert details["logged_ahead"] > 0 and details["logged_behind"] > 0, details
    # A deadline is the API's promise on the system's clock: none of 120 s expired.
    assert not expired, details
    assert {r.status for r in rows.values()} == {"succeeded"}, details
    # Leases are the Redis server's idle times: nothing was taken over, nothing ran again.
    assert reclaims == 0 and all(r.attempts == 1 for r in rows.values()), details
    assert not times_off, details
    # The heartbeats the API counts live workers by: never minutes off, never erasing the
    # other worker's, both workers live throughout.
    assert details["heartbeat_ahead_s"] < 5 and details["heartbeat_behind_s"] < 15, details
    assert details["steady_heartbeat_missing"] == 0, details
    assert details["fewest_live_workers"] == 2, details
    # ... and it claimed jobs with deadlines while its clock was off (by the true times
    # written, which the assertion on times_off vouches for).
    assert details["with_deadline_claimed_while_stepped"] > 0, details
    assert details["run_by_steady"] > 0, details
    assert all(p.alive() and p.starts == 1 for p in [steady, stepped, stack.procs["api"]])


API_JOBS = 100


def test_an_api_clock_behind_stamps_jobs_and_their_deadlines_by_the_system_clock(
    make_stack: Callable[..., Stack], record: Callable[[Figures], None], tmp_path: Any
) -> None:
    """The API's host five minutes behind: jobs are stamped by the Redis server's clock, so a
    120 s deadline is 120 s from when the job truly came (stamped by the host's, every such
    deadline would be three minutes past already, and every job would expire)."""
    so = library() or missing_service("libfaketime is not installed (the dev extra's wheel)")
    clock = SteppedClock(tmp_path / "clock", so)
    clock.step(-STEP_S)
    stack = make_stack()
    api = stack.start_api(wait=False, env=clock.env())
    worker = stack.start_worker("w1", wait=False)
    stack.wait_worker(worker)
    stack.wait_api(api)
    began = dt.datetime.now(dt.UTC)
    started = time.monotonic()
    jobs = sim_jobs(API_JOBS)
    for body in jobs:
        body["deadline_ms"] = DEADLINE_MS
    submission = stack.submit(jobs)
    accounting = stack.account("API clock behind", submission, started, 60, record)
    ended = dt.datetime.now(dt.UTC)
    rows = accounting.rows
    created, deadlines = created_and_deadlines(stack, list(rows))
    slack = dt.timedelta(seconds=SLACK_S)
    details = accounting.figures.details
    details.update(
        step_s=-STEP_S,
        expired=sum(1 for r in rows.values() if r.status == "expired"),
        created_off=sum(1 for t in created.values() if not began - slack <= t <= ended + slack),
        deadline_not_120_s=sum(
            1
            for j, d in deadlines.items()
            if d is None or abs((d - created[j]).total_seconds() - DEADLINE_MS / 1000) > 0.01
        ),
        logged_behind=sum(
            1 for t in logged_times(api) if t < began - dt.timedelta(seconds=STEP_S - 60)
        ),
    )
    stack.assert_nothing_lost(accounting)
    stack.assert_computed_once(accounting)
    assert details["logged_behind"] > 0, details  # the API's own log: its clock was behind
    assert details["created_off"] == 0 and details["deadline_not_120_s"] == 0, details
    assert details["expired"] == 0, details
    assert {r.status for r in rows.values()} == {"succeeded"}, details
