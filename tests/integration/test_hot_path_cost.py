"""What one job costs the shared parts, counted: SQL statements and Redis commands per
job on the hot path (submit, run, long-poll), on real PostgreSQL and a Redis of the
test's own (``INFO commandstats`` counts every command, those a script runs included).

These are ceilings at today's figures, not goals: a change that adds a statement or a
Redis command per job (or per request) fails here, where a benchmark would only drift.
Lower a ceiling when the path gets cheaper. bench/capacity.py measures the same
counters with their CPU cost, under concurrency.

Each submission is sent alone (a group of one, the costliest case), the batch is
drained whole, and each finished job is long-polled once; the counts are exact for a
given code path, so the ceilings carry no margin beyond the background work that may
land inside a phase (the API's and the worker's timers), bounded by BACKGROUND.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import event, select
from sqlalchemy.engine import Engine

from api.jobs.reads import LoopReader
from api.state import app_state
from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import Job, make_engine, make_sessionmaker
from harness import webclient
from harness.served import served
from harness.services import migrated_postgres_database, started_redis
from harness.worker import running_worker

JOBS = 32


@dataclass
class Phase:
    statements: list[str] = field(default_factory=list)
    commands: list[tuple[str, str]] = field(default_factory=list)  # (name, first key)


class Counted:
    """Every SQL statement the API's and the worker's engines send, and every command Redis
    runs (MONITOR: a script's own commands too), with the key each names."""

    END = "cost-test-phase-end"

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.statements: list[str] = []
        self.ignored: set[Engine] = set()
        self.lock = threading.Lock()

    def __call__(self, conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if conn.engine in self.ignored:
            return
        with self.lock:
            self.statements.append(" ".join(statement.split()))

    def sent(self, statement: str, _parameters: Any) -> None:
        """A statement of the API's reader (api.jobs.reads.LoopReader)."""
        with self.lock:
            self.statements.append(" ".join(statement.split()))

    @contextmanager
    def phase(self) -> Iterator[Phase]:
        found = Phase()
        commands: list[tuple[str, str]] = []
        ready = threading.Event()

        def monitor() -> None:
            with self.client.monitor() as watching:
                ready.set()
                for seen in watching.listen():
                    name, _, rest = seen["command"].partition(" ")
                    if name == "ECHO" and rest == self.END:
                        return
                    commands.append((name.lower(), rest.split(" ", 1)[0]))

        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        assert ready.wait(10)
        with self.lock:
            self.statements.clear()
        yield found
        self.client.echo(self.END)
        watcher.join(timeout=30)
        found.commands = commands
        with self.lock:
            found.statements = list(self.statements)


@pytest.fixture
def counted(tmp_path: Path) -> Iterator[tuple[Settings, Counted]]:
    with started_redis(tmp_path / "redis") as redis_url, migrated_postgres_database() as url:
        settings = Settings(
            redis_url=redis_url,
            database_url=url,
            data_dir=tmp_path,
            key_prefix="cost",
            models="sim",
            model_parameters={"sim": {"latency_base_ms": 2.0, "latency_per_cost_ms": 0.0}},
            batch_max_size=JOBS,
            reconcile_interval_s=3600.0,
        )
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        found = Counted(client)
        event.listen(Engine, "before_cursor_execute", found)
        try:
            yield settings, found
        finally:
            event.remove(Engine, "before_cursor_execute", found)
            client.close()


def test_the_hot_path_sends_no_more_statements_or_redis_commands_per_job(
    counted: tuple[Settings, Counted],
) -> None:
    settings, count = counted
    engine = make_engine(settings.sqlalchemy_url)
    count.ignored.add(engine)  # the test's own reads
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        token = create_key(session, "cost").token
    headers = {"Authorization": f"Bearer {token}"}
    with served(settings) as api, webclient.client(base_url=api.base, headers=headers) as http:
        reader = app_state(api.app).reader
        assert isinstance(reader, LoopReader)  # PostgreSQL's reads go around the engine
        reader.sent.append(count.sent)
        http.post("/v1/jobs", json={"model": "sim", "input": {"cost": 1}})  # warm caches
        ids: list[str] = []
        with count.phase() as submit:
            for _ in range(JOBS):
                answer = http.post("/v1/jobs", json={"model": "sim", "input": {"cost": 1}})
                assert answer.status_code == 202, answer.text
                ids.append(answer.json()["id"])
        with count.phase() as run, running_worker(settings, "sim", "cost"):
            until = time.monotonic() + 120
            while True:
                with sessions() as session:
                    left = session.scalar(select(Job.id).where(Job.status != "succeeded").limit(1))
                if left is None:
                    break
                assert time.monotonic() < until, "the worker did not drain the jobs"
                time.sleep(0.05)
        with count.phase() as poll:
            for job in ids:
                assert http.get(f"/v1/jobs/{job}", params={"wait": 5}).json()["status"] == (
                    "succeeded"
                )
    with sessions() as session:
        batches = len(set(session.scalars(select(Job.batch_id).where(Job.id.in_(ids)))))
    engine.dispose()
    why = "\n".join(
        f"{name}: {Counter(job_statements(phase.statements))} {Counter(job_driven(phase.commands))}"
        for name, phase in (("submit", submit), ("run", run), ("poll", poll))
    )

    # Submitting: the job's row and its key's outstanding count, one statement
    # (api.jobs.at_once); the enqueue script's call, its XADD to the tenant's stream, the
    # enqueue sequence's INCRBY, the queued bytes' INCRBY and the tenant's listing (ZADD);
    # the arrival rate is read off the sequence.
    assert len(job_statements(submit.statements)) <= JOBS, why
    assert len(job_driven(submit.commands)) <= 5 * JOBS, why
    # Running: per batch, not per job. Claiming its jobs (one UPDATE returning those it
    # started, those started before left out), writing the outcomes (which return what
    # to tell webhooks and backfills), the keys' outstanding counts; one statement more
    # once (the pending entries re-read at start). In Redis,
    # the acknowledging script's call, its XACK, XDEL and the queued bytes' DECRBY, and
    # the PUBLISH that wakes long-polls.
    assert len(job_statements(run.statements)) <= 3 * batches + 1, why
    assert len(job_driven(run.commands)) <= 5 * batches, why
    # A long-poll of a finished job: its row, and nothing of Redis.
    assert len(job_statements(poll.statements)) <= JOBS, why
    assert job_driven(poll.commands) == [], why


def test_a_wait_for_a_job_accepted_here_reads_its_row_once(
    counted: tuple[Settings, Counted],
) -> None:
    """A job this API process accepted is known not to have ended until its completion
    comes: a wait for it (``POST ?wait=``, or a long-poll sent right after the 202) reads
    its row when woken, not before as well. The sim takes 300 ms a batch, so every wait
    here starts before its job ends."""
    settings, count = counted
    settings = settings.model_copy(
        update={"model_parameters": {"sim": {"latency_base_ms": 300.0, "latency_per_cost_ms": 0.0}}}
    )
    engine = make_engine(settings.sqlalchemy_url)
    count.ignored.add(engine)
    with make_sessionmaker(engine)() as session:
        token = create_key(session, "cost").token
    engine.dispose()
    headers = {"Authorization": f"Bearer {token}"}
    job = {"model": "sim", "input": {"cost": 1}}
    with (
        served(settings) as api,
        webclient.client(base_url=api.base, headers=headers) as http,
        running_worker(settings, "sim", "cost"),
    ):
        reader = app_state(api.app).reader
        assert isinstance(reader, LoopReader)
        reads: list[str] = []  # the API's reads of jobs (not the worker's statements)
        reader.sent.append(lambda statement, _parameters: reads.append(statement))
        assert http.post("/v1/jobs", params={"wait": 5}, json=job).status_code == 200  # warm
        reads.clear()
        for _ in range(3):
            answer = http.post("/v1/jobs", params={"wait": 5}, json=job)
            assert answer.status_code == 200, answer.text
            assert answer.json()["status"] == "succeeded"
        for _ in range(3):
            accepted = http.post("/v1/jobs", json=job)
            assert accepted.status_code == 202, accepted.text
            polled = http.get(f"/v1/jobs/{accepted.json()['id']}", params={"wait": 5})
            assert polled.json()["status"] == "succeeded"
        waited = [s for s in reads if "FROM jobs" in s]
        assert len(waited) == 6, "\n".join(waited)
        # Another process's job (or one this one has forgotten) is read first, as before.
        other = http.post("/v1/jobs", json=job).json()["id"]
        app_state(api.app).hub.wake_all()
        reads.clear()
        polled = http.get(f"/v1/jobs/{other}", params={"wait": 5})
        assert polled.json()["status"] == "succeeded"
        assert len([s for s in reads if "FROM jobs" in s]) == 2, "\n".join(reads)


# Statements on a clock: the worker's look at the model's activated version and the
# API's at the models an operator unloaded (both every FERRY_MODEL_POLL_S), the API's
# look at a key past FERRY_KEY_CACHE_S.
CLOCKED_TABLES = ("model_activations", "model_unloads", "api_keys")


def job_statements(statements: list[str]) -> list[str]:
    return [s for s in statements if not any(f"FROM {table}" in s for table in CLOCKED_TABLES)]


# What runs on a clock, not per job: rate-limit windows, the learned figures and the
# workers' presence, versions, wake-ups; a connection's HELLO; the worker's reads while
# it waits (a read per step, however many jobs it brings); the API's look at a model's
# queue for the wait it quotes and the queue's bounds (its streams' lengths and queued
# bytes, at most every 250 ms per model); a worker's or an API process's reading of the
# server's clock (TIME, every 10 s: core.streams.target.ServerClock).
CLOCKED_KEYS = (":limits:", ":stats", ":workers", ":versions", ":restarting", ":wake")
WAITING_READS = {"hello", "xreadgroup", "zrange", "get", "xgroup", "xlen", "time"}
# A transaction's own brackets: what it holds is counted.
FRAMING = {"multi", "exec"}


def job_driven(commands: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [
        (name, key)
        for name, key in commands
        if name not in WAITING_READS | FRAMING and not any(part in key for part in CLOCKED_KEYS)
    ]
