"""The fault suite's stack: a real Ferry of separate processes, to be broken on purpose.

A stack has a redis-server of its own (own port, own data directory, so it can
be killed and wiped), a PostgreSQL database the caller made for it, optionally
a TCP proxy in front of that database (so the database can be cut off), the API
as its own process and whichever workers and Celery processes the scenario
needs, started with ``python -m ferry`` exactly as an operator would.
``close()`` kills every process it started, then Redis and the proxy.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import Engine, func, select
from sqlalchemy.engine import make_url

from backends.sim import read_witness
from core.db.keys import create_key
from core.db.schema import TERMINAL_STATUSES, Job, make_engine, make_sessionmaker
from core.streams.protocol import dead_letter_key, done_channel, workers_key
from core.streams.queues import lane_depths
from ferry.local_redis import start_redis
from harness import POLL_S, webclient
from harness.accounting import (
    Accounting,
    Computations,
    Executions,
    Figures,
    count_computations,
    count_executions,
    tally,
)
from harness.listener import DoneListener
from harness.ports import free_port
from harness.processes import Proc, Processes
from harness.proxy import TcpProxy
from harness.submitting import Submission, Submitter
from harness.witness import read_transitions
from workers.gpu.executions import read_executions

MODEL = "sim"
START_TIMEOUT_S = 60.0


class Stack(Processes):
    """A Ferry stack of real processes around one Redis and one PostgreSQL database."""

    def __init__(
        self, tmp: Path, database_url: str, env: dict[str, str], proxy_db: bool = False
    ) -> None:
        # Everything close() releases, before anything is started.
        super().__init__(tmp)
        self.prefix = f"ferryfault-{secrets.token_hex(3)}"
        self.database_url = database_url  # direct: what the harness checks with
        self.proxy: TcpProxy | None = None
        self.redis_process: subprocess.Popen[bytes] | None = None
        self.listener = DoneListener(done_channel(self.prefix))
        self.engine: Engine = make_engine(database_url)
        try:
            self._start(env, proxy_db)
        except BaseException:
            self.close()
            raise

    def _start(self, env: dict[str, str], proxy_db: bool) -> None:
        app_database_url = self.database_url
        if proxy_db:
            url = make_url(self.database_url)
            self.proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
            app_database_url = url.set(host="127.0.0.1", port=self.proxy.port).render_as_string(
                hide_password=False
            )
        self.redis_port = free_port()
        self.redis_dir = self.tmp / "redis-data"
        # The workers' record of what they computed: files, so that it outlives
        # Redis restarted empty, the database down and kill -9.
        self.execution_dir = self.tmp / "executions"
        # The sim's own record of what it computed, each output with a nonce: the
        # witness the counts come from (harness.accounting).
        self.witness_dir = self.tmp / "computations"
        self.start_redis()
        self.redis = redis.Redis.from_url(
            self.redis_url, decode_responses=True, socket_connect_timeout=1, socket_timeout=5
        )
        self.api_port = free_port()
        self.base = f"http://127.0.0.1:{self.api_port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        self.env.update(
            FERRY_REDIS_URL=self.redis_url,
            FERRY_DATABASE_URL=app_database_url,
            FERRY_KEY_PREFIX=self.prefix,
            FERRY_DATA_DIR=str(self.tmp / "data"),
            FERRY_API_PORT=str(self.api_port),
            FERRY_MODELS=MODEL,
            FERRY_EXECUTION_LOG_DIR=str(self.execution_dir),
            FERRY_SIM_WITNESS_DIR=str(self.witness_dir),
            FERRY_LOG_LEVEL="INFO",
            PYTHONUNBUFFERED="1",
        )
        self.env.update(env)
        self.max_attempts = int(self.env.get("FERRY_MAX_ATTEMPTS", "3"))
        with make_sessionmaker(self.engine)() as session:
            self.token = create_key(session, "faults").token
        self.submitter = Submitter(self.base, self.token, self._stop)
        self.supervise()
        self.listener.start(self.redis_url)

    # -- Redis ------------------------------------------------------------

    def start_redis(self) -> None:
        process, url = start_redis(self.redis_dir, self.redis_port)
        self.redis_process, self.redis_url = process, url

    def kill_redis(self, wipe: bool) -> None:
        """kill -9 the redis-server; with ``wipe``, its data directory goes too."""
        assert self.redis_process is not None
        self.redis_process.kill()
        self.redis_process.wait(timeout=10)
        if self.redis_process.stderr:
            self.redis_process.stderr.close()
        self.redis_process = None
        if wipe:
            shutil.rmtree(self.redis_dir)

    # -- Ferry's processes ------------------------------------------------

    def start_api(self, wait: bool = True, env: dict[str, str] | None = None) -> Proc:
        proc = self.spawn("api", ["api"], False, **(env or {}))
        if wait:
            self.wait_api(proc)
        return proc

    def wait_api(self, proc: Proc) -> None:
        """Until the API answers /readyz with 200."""
        until = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if webclient.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            assert proc.alive(), f"the API exited at start:\n{self.tail(proc)}"
            assert time.monotonic() < until, f"the API was not ready:\n{self.tail(proc)}"
            time.sleep(0.1)

    def start_worker(
        self,
        name: str,
        supervised: bool = False,
        wait: bool = True,
        model: str = MODEL,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """A worker of ``model`` (the sim unless named), ``env`` added to its environment."""
        args = ["worker", "--model", model, "--name", name]
        proc = self.spawn(name, args, supervised, **(env or {}))
        if wait:
            self.wait_worker(proc, model)
        return proc

    def start_workers(
        self,
        *names: str,
        supervised: bool = False,
        envs: dict[str, dict[str, str]] | None = None,
    ) -> list[Proc]:
        """A worker per name, all started before any is waited for: each one's start
        (its imports, its model) takes seconds, which they then spend side by side.
        ``envs``: what a worker's environment adds, by its name."""
        envs = envs or {}
        workers = [
            self.start_worker(name, supervised, wait=False, env=envs.get(name)) for name in names
        ]
        for worker in workers:
            self.wait_worker(worker)
        return workers

    def start(
        self,
        *workers: str,
        supervised: bool = False,
        envs: dict[str, dict[str, str]] | None = None,
    ) -> list[Proc]:
        """The API and a worker per name, started side by side, then each waited for."""
        api = self.start_api(wait=False)
        started = self.start_workers(*workers, supervised=supervised, envs=envs)
        self.wait_api(api)
        return started

    def wait_worker(self, proc: Proc, model: str = MODEL) -> None:
        """Until the worker's heartbeat is in Redis (it has joined the group and reads)."""
        until = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(redis.RedisError):
                if self.redis.zscore(workers_key(self.prefix, model), proc.name) is not None:
                    return
            assert proc.supervised or proc.alive(), f"{proc.name} exited:\n{self.tail(proc)}"
            assert time.monotonic() < until, f"{proc.name} never beat:\n{self.tail(proc)}"
            time.sleep(POLL_S)

    # -- the API ------------------------------------------------------------

    def submit(
        self, bodies: list[dict[str, Any]], threads: int = 6, retry_s: float = 60.0
    ) -> Submission:
        return self.submitter.submit(tagged(bodies), threads, retry_s)

    def submit_in_background(
        self,
        bodies: list[dict[str, Any]],
        threads: int = 6,
        retry_s: float = 60.0,
        rate_per_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> tuple[Submission, Future[None]]:
        """All of ``bodies`` at once, or with ``rate_per_s`` each at its time until ``stop``."""
        return self.submitter.submit_in_background(
            tagged(bodies), threads, retry_s, rate_per_s, stop
        )

    # -- the database ---------------------------------------------------------

    def statuses(self, ids: list[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        with self.engine.connect() as conn:
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                for job_id, status in conn.execute(
                    select(Job.id, Job.status).where(Job.id.in_(chunk))
                ):
                    found[job_id] = status
        return found

    def terminal_count(self) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(Job).where(Job.status.in_(TERMINAL_STATUSES))
                ).scalar_one()
            )

    def rows(self, ids: list[str]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        with self.engine.connect() as conn:
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                for row in conn.execute(
                    select(
                        Job.id,
                        Job.status,
                        Job.attempts,
                        Job.error,
                        Job.input,
                        Job.output,
                        Job.batch_size,
                        Job.started_at,
                        Job.finished_at,
                    ).where(Job.id.in_(chunk))
                ):
                    found[row.id] = row
        return found

    def wait_terminal(self, ids: list[str], timeout: float) -> bool:
        """Until every id is terminal (True), or the deadline (False)."""
        until = time.monotonic() + timeout
        waiting = list(ids)
        while waiting:
            with contextlib.suppress(Exception):
                found = self.statuses(waiting)
                waiting = [i for i in waiting if found.get(i) not in TERMINAL_STATUSES]
            if not waiting:
                return True
            if time.monotonic() > until:
                return False
            time.sleep(0.25)
        return True

    def stream_entries(self) -> int:
        """Entries still in the model's lane streams (acknowledged ones are deleted)."""
        return sum(lane_depths(self.redis, self.prefix, MODEL).values())

    def dead_letters(self) -> list[dict[str, str]]:
        entries: Any = self.redis.xrange(dead_letter_key(self.prefix, MODEL))
        return [dict(fields) for _id, fields in entries]

    def wait_quiet(self, timeout: float = 10.0) -> int:
        """Until the lane streams are empty; returns what is left at the deadline."""
        until = time.monotonic() + timeout
        while True:
            left = -1
            with contextlib.suppress(redis.RedisError):
                left = self.stream_entries()
                if left == 0:
                    return 0
            if time.monotonic() > until:
                return left
            time.sleep(0.1)

    # -- accounting -----------------------------------------------------------

    def executions(self) -> Executions:
        """What the workers computed so far, from their own execution record."""
        return count_executions(read_executions(self.execution_dir), self.died())

    def computations(self, rows: dict[str, Any]) -> Computations:
        """What the sim computed so far of the jobs of ``rows``, by its witness record."""
        job_of_tag = {
            row.input["tag"]: job_id
            for job_id, row in rows.items()
            if isinstance(row.input, dict) and "tag" in row.input
        }
        return count_computations(read_witness(self.witness_dir), job_of_tag, self.died())

    def account(
        self,
        scenario: str,
        submission: Submission,
        started: float,
        timeout: float,
        record: Callable[[Figures], None],
    ) -> Accounting:
        """Wait for every accepted job to end, then count, from the witnesses: completed, lost,
        run, written."""
        accepted = submission.accepted
        self.wait_terminal(accepted, timeout)
        seconds = time.monotonic() - started
        left = self.wait_quiet()
        time.sleep(0.5)  # a publication racing the last commit
        published = self.listener.snapshot()
        rows = self.rows(accepted)
        transitions = read_transitions(self.engine, accepted)
        computations = self.computations(rows)
        own_record = self.executions()
        figures = tally(
            scenario,
            submission,
            rows,
            transitions,
            computations,
            seconds,
            self.max_attempts,
            published=published,
            record=own_record,
            stream_entries_left=left,
            # Rows no 202 answered for (a request that failed after its commit
            # and was not retried): work nobody knows was accepted.
            orphan_rows=self.row_count() - len(rows),
            restarts={p.name: p.exits for p in self.procs.values() if p.exits},
        )
        record(figures)
        return Accounting(figures, rows, published, computations, own_record, transitions)

    def row_count(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(Job)).scalar_one())

    def assert_nothing_lost(self, accounting: Accounting) -> None:
        """Nothing lost, no result written twice, no job computed twice but after a crash."""
        f = accounting.figures
        context = self._context(f)
        assert not f.details["rejected"], context
        assert f.submitted > 0, context
        assert f.lost == 0, context
        assert f.written_twice == 0, context
        assert f.run_twice == 0, context
        assert not f.details["succeeded_unexecuted"], context
        assert not f.details["terminal_untracked"], context
        assert f.details["untagged_computations"] == 0, context
        assert f.details["bad_attempts"] == 0, context
        assert f.details["orphan_rows"] == 0, context

    def assert_computed_once(self, accounting: Accounting) -> None:
        """Without a crash: every job that succeeded was computed exactly once, by the sim's
        witness, and no other more than once (an input that made the model raise has no
        output, so no computation)."""
        f = accounting.figures
        per_job = accounting.executions.per_job
        wrong = {
            job_id: (row.status, per_job[job_id])
            for job_id, row in accounting.rows.items()
            if per_job[job_id] > 1 or (row.status == "succeeded") != (per_job[job_id] == 1)
        }
        assert not wrong, (wrong, self._context(f))
        assert f.after_crash == 0, self._context(f)

    def _context(self, figures: Figures) -> str:
        return f"{json.dumps(asdict(figures), default=str, indent=1)}\n{self.diagnostics()}"

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Kill every process this stack started, then Redis, the proxy and the listener."""
        self.stop_processes()
        self.listener.stop()
        if hasattr(self, "redis"):
            self.redis.close()
        if self.redis_process is not None:
            self.redis_process.kill()
            self.redis_process.wait(timeout=10)
            if self.redis_process.stderr:
                self.redis_process.stderr.close()
        if self.proxy is not None:
            self.proxy.close()
        self.engine.dispose()


def without_nonce(output: Any) -> Any:
    """A sim output as the model computes it, less the nonce its witness adds."""
    return {k: v for k, v in output.items() if k != "nonce"} if isinstance(output, dict) else output


def tagged(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bodies, each sim input given a tag of its own (the sim's witness names it)."""
    return [
        {**body, "input": {**body["input"], "tag": uuid.uuid4().hex}}
        if body.get("model") == MODEL
        and isinstance(body.get("input"), dict)
        and "tag" not in body["input"]
        else body
        for body in bodies
    ]


def sim_jobs(count: int, costs: tuple[int, ...] = (1, 2, 3, 4)) -> list[dict[str, Any]]:
    return [{"model": MODEL, "input": {"cost": costs[i % len(costs)]}} for i in range(count)]


def sim_batches(
    base_ms: float, per_cost_ms: float | None = None, max_size: int | None = None
) -> dict[str, str]:
    """A stack's settings for the sim's batches: each takes ``base_ms`` plus ``per_cost_ms``
    a unit of cost, and holds ``max_size`` jobs at the most (Ferry's defaults where not
    given)."""
    settings = {"FERRY_SIM_LATENCY_BASE_MS": f"{base_ms:g}"}
    if per_cost_ms is not None:
        settings["FERRY_SIM_LATENCY_PER_COST_MS"] = f"{per_cost_ms:g}"
    if max_size is not None:
        settings["FERRY_BATCH_MAX_SIZE"] = str(max_size)
    return settings
