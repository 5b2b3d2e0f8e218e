# ruff: noqa: RUF001
"""What one job costs each shared part, measured; and where a deployment meets its first wall.

One process runs the API (uvicorn, on a thread) and a sim worker (the sim
model sleeps instead of computing, so every CPU second the worker spends is
Ferry's own work around the model) against a Redis of its own and a fresh
PostgreSQL database that already holds ``--history`` finished jobs (100,000
by default: what a deployment keeps within its retention; the size of the
table decides the plans its statements get), analyzed, as autovacuum keeps
it, before the first phase and again after the submissions. Three phases,
one at a time, so that each part's cost is read off counters that only it
moves:

* **submit**: N jobs through ``POST /v1/jobs`` from C concurrent clients, no
  worker running: the API's cost per submission;
* **run**: the worker drains the N jobs in batches of up to B: the worker's
  cost per job and per batch;
* **poll**: one ``GET /v1/jobs/{id}?wait=`` long-poll per finished job;

and the enqueue alone, straight to Redis at the group sizes a group commit
reaches: a script call per job against one per tenant's stream, side by side.

Per phase: Redis's commands (``INFO commandstats``), bytes in and out, and
CPU (``INFO cpu``, less what it spends idle over as long); PostgreSQL's transactions and rows
(``pg_stat_database``; each table's scans and rows, ``pg_stat_user_tables``) and
statements (SQLAlchemy's events in this process, and what the API's reader sends itself),
and the CPU of every PostgreSQL backend but the benchmark's own (its counters' reads, its
count of what is left); this process's CPU (for the submit and poll phases: the API's;
for the run phase: the worker's). The HTTP clients run in a process of their own, as a
deployment's do: on threads of this one, their Python and the API's would take turns
with the interpreter's lock, and the switching would count as the API's CPU (it read
1.6 to 1.7 times the long-poll's cost that way). From them, :func:`walls` works out at
how many jobs per second each part saturates, one core each.

    python -m bench.capacity [--jobs 3000] [--batch 32] [--clients 16] [--rounds 3]
                             [--history 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import event, func, select, text
from sqlalchemy.engine import Engine

from api.jobs.reads import LoopReader
from api.state import app_state
from bench import results
from bench.report import Results, Spread, measured_on, table
from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import Job, make_engine, make_sessionmaker
from core.streams.protocol import JobMessage, Scripts
from harness.served import served
from harness.services import migrated_postgres_database, started_redis
from harness.worker import running_worker

TICKS = os.sysconf("SC_CLK_TCK")
# PostgreSQL's PGSTAT_IDLE_INTERVAL (10 s) and a margin: by then an idle backend has
# reported what it counted.
STATS_FLUSH_S = 11.0
# Each table's scans and rows (pg_stat_user_tables), per phase: which table a phase
# reads by sequential scan, and which it writes.
TABLE_COUNTERS = (
    "seq_scan",
    "seq_tup_read",
    "idx_scan",
    "idx_tup_fetch",
    "n_tup_ins",
    "n_tup_upd",
    "n_tup_del",
    "n_tup_hot_upd",
)
# The enqueue alone, at the group sizes a group commit reaches (1 when idle, up to
# FERRY_SUBMIT_GROUP_MAX under load), from this many API keys.
ENQUEUE_GROUPS = (1, 16, 256)
ENQUEUE_TENANTS = 8


def _ticks(path: str) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def postgres_cpu_s(admin: Engine, database: str) -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend serving ``database`` now (by process id):
    other databases' work on a shared server is left out."""
    with admin.connect() as conn:
        pids = conn.scalars(
            text("SELECT pid FROM pg_stat_activity WHERE datname = :name"), {"name": database}
        ).all()
    return {int(pid): _ticks(f"/proc/{pid}/stat") for pid in pids}


class Statements:
    """SQL statements this process sends, counted by the SQLAlchemy event every engine fires."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()

    def __call__(self, *_args: Any) -> None:
        with self.lock:
            self.count += 1

    @contextmanager
    def listening(self) -> Iterator[Statements]:
        event.listen(Engine, "before_cursor_execute", self)
        try:
            yield self
        finally:
            event.remove(Engine, "before_cursor_execute", self)


@dataclass(eq=False)
class Counters:
    """Readings of every counter a phase moves."""

    client: redis.Redis
    admin: Engine
    engine: Engine
    database: str
    sql: Statements
    backends: dict[int, float] = field(init=False, default_factory=dict)

    def read(self, backends: bool = True) -> dict[str, float]:
        """The counters now; PostgreSQL's backends' CPU kept apart, by process id (and
        left as last read unless ``backends``)."""
        if backends:
            self.backends = postgres_cpu_s(self.admin, self.database)
        info = self.client.info("all")
        commands = {
            name.removeprefix("cmdstat_"): float(stats["calls"])
            for name, stats in info.items()
            if name.startswith("cmdstat_")
        }
        tables: dict[str, float] = {}
        with self.engine.connect() as conn:
            for found in conn.execute(
                text(f"SELECT relname, {', '.join(TABLE_COUNTERS)} FROM pg_stat_user_tables")
            ):
                for counter in TABLE_COUNTERS:
                    tables[f"table:{found.relname}:{counter}"] = float(getattr(found, counter) or 0)
        with self.admin.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted, tup_returned "
                    "FROM pg_stat_database WHERE datname = :name"
                ),
                {"name": self.database},
            ).one()
        return {
            "redis_commands": sum(commands.values()) - commands.get("info", 0.0),
            "redis_in_bytes": float(info["total_net_input_bytes"]),
            "redis_out_bytes": float(info["total_net_output_bytes"]),
            "redis_cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
            "db_transactions": float(row.xact_commit),
            "db_rows_written": float(row.tup_inserted + row.tup_updated + row.tup_deleted),
            "db_rows_read": float(row.tup_returned),
            "db_statements": float(self.sql.count),
            "process_cpu_s": time.process_time(),
            **{f"redis:{name}": calls for name, calls in commands.items()},
            **tables,
        }


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


async def _submit_one(client: httpx.AsyncClient, _item: Any) -> str:
    answer = await client.post("/v1/jobs", json={"model": "sim", "input": {"cost": 8}})
    answer.raise_for_status()
    return str(answer.json()["id"])


async def _poll_one(client: httpx.AsyncClient, job_id: Any) -> None:
    answer = await client.get(f"/v1/jobs/{job_id}", params={"wait": 5})
    assert answer.json()["status"] == "succeeded"


Request = Callable[[httpx.AsyncClient, Any], Awaitable[str | None]]


def _drive(base: str, token: str, clients: int, call: Request, items: list[Any]) -> list[str]:
    """``call(client, item)`` for every item, from ``clients`` concurrent connections;
    what the calls answered (a submission's id)."""
    answered: list[str] = []

    async def main() -> None:
        headers = {"Authorization": f"Bearer {token}"}
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits) as client:
            queue = iter(items)

            async def one_client() -> None:
                for item in queue:
                    if (found := await call(client, item)) is not None:
                        answered.append(found)

            await asyncio.gather(*(one_client() for _ in range(clients)))

    asyncio.run(main())
    return answered


def concurrently(base: str, token: str, clients: int, call: Request, items: list[Any]) -> list[str]:
    """:func:`_drive` in a process of its own (``call`` a module-level function): in the
    API's process, the clients' Python would take turns with the API's for the
    interpreter's lock, and the API's CPU would count the switching (a deployment's
    clients are elsewhere)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_drive, base, token, clients, call, items).result()


def submit(base: str, token: str, jobs: int, clients: int) -> list[str]:
    """``jobs`` submissions; their ids."""
    return concurrently(base, token, clients, _submit_one, list(range(jobs)))


def poll(base: str, token: str, ids: list[str], clients: int) -> None:
    """A long-poll of every (finished) job."""
    concurrently(base, token, clients, _poll_one, ids)


def one_round(
    jobs: int,
    batch: int,
    clients: int,
    enqueue_messages: int,
    idle_s: float = 3.0,
    history: int = 0,
) -> dict[str, Any]:
    sql = Statements()
    with (
        tempfile.TemporaryDirectory(prefix="ferry-capacity-") as tmp,
        started_redis(Path(tmp) / "redis") as redis_url,
        migrated_postgres_database() as database_url,
        sql.listening(),
    ):
        settings = Settings(
            redis_url=redis_url,
            database_url=database_url,
            data_dir=Path(tmp),
            key_prefix="capacity",
            models="sim",
            model_parameters={"sim": {"latency_base_ms": 2.0, "latency_per_cost_ms": 0.01}},
            batch_max_size=batch,
            # What a job costs is measured, not the key's limit: on a fast host the
            # submissions come faster than the default 1,000 a second.
            rate_limit="1000000/second",
            # One process drives everything: the worker must not run before the run phase.
            reconcile_interval_s=3600.0,
        )
        engine = make_engine(settings.sqlalchemy_url)
        # This benchmark's own backends (its counters' reads, the run phase's count of
        # what is left): their CPU is not the parts'.
        own: set[int] = set()

        @event.listens_for(engine, "connect")
        def _own(dbapi_connection: Any, _record: Any) -> None:
            with dbapi_connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                own.add(int(cursor.fetchone()[0]))

        sessions = make_sessionmaker(engine)
        with sessions() as session:
            created = create_key(session, "capacity")
            token = created.token
        add_history(engine, created.id, history)
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        database = engine.url.database or ""
        admin = make_engine(engine.url.set(database="postgres").render_as_string(False))
        counters = Counters(client, admin, engine, database, sql)
        phases: dict[str, dict[str, float]] = {}
        ended: dict[int, float] = {}  # backends closed during a phase: their CPU at the end

        def idle_rates(seconds: float = idle_s) -> dict[str, float]:
            """What Redis and this process spend per second doing nothing (timers,
            heartbeats, the API's background tasks): taken off each phase's figures."""
            before = counters.read()
            time.sleep(seconds)
            found = delta(before, counters.read())
            return {
                "redis_cpu_s": found["redis_cpu_s"] / seconds,
                "process_cpu_s": found["process_cpu_s"] / seconds,
            }

        def measured(name: str, work: Callable[[], None]) -> None:
            idle = idle_rates()
            client.config_resetstat()
            before = counters.read()
            backends = counters.backends
            started = time.perf_counter()
            work()
            seconds = time.perf_counter() - started
            found = delta(before, counters.read())
            # A backend reports its counters at most once a second, and an idle one may
            # hold them up to 10 s (PostgreSQL 15): read at once, a phase's last second of
            # rows would land in the gap before the next phase (the submissions' inserts
            # read 0.71 a job that way). So PostgreSQL's are read again once reported;
            # the CPU (from /proc and INFO), Redis's commands and the statements sent, at
            # once.
            time.sleep(STATS_FLUSH_S)
            found |= {
                name: value
                for name, value in delta(before, counters.read(backends=False)).items()
                if name.startswith(("db_rows", "db_transactions", "table:"))
            }
            # A backend that started meanwhile counts from zero; one that ended, as it
            # was last read.
            found["postgres_cpu_s"] = sum(
                cpu - backends.get(pid, 0.0)
                for pid, cpu in (ended | counters.backends).items()
                if pid not in own
            )
            ended.clear()
            found["seconds"] = seconds
            found["redis_cpu_s"] -= idle["redis_cpu_s"] * seconds
            found["part_cpu_s"] = found.pop("process_cpu_s") - idle["process_cpu_s"] * seconds
            found["idle_redis_cpu_per_s"] = idle["redis_cpu_s"]
            phases[name] = found

        with served(settings) as api:
            reader = app_state(api.app).reader
            if isinstance(reader, LoopReader):  # its reads go around the engines: counted here
                reader.sent.append(sql)
            ids: list[str] = []

            def submitting() -> None:
                ids.extend(submit(api.base, token, jobs, clients))

            measured("submit", submitting)
            # The statistics as autovacuum keeps them (its analyze follows within a minute
            # of the rows arriving; a phase is shorter), so the later phases run on the plans
            # a deployment's table gets.
            analyze(engine)

            def running() -> None:
                with running_worker(settings, "sim", "capacity") as worker:
                    until = time.monotonic() + 300
                    while time.monotonic() < until:
                        with sessions() as session:
                            # A count, which the status index answers: with LIMIT 1 the
                            # planner bets on a scan that meets one soon, and reads the
                            # history first; that would be this phase's largest cost.
                            left = session.scalar(
                                select(func.count())
                                .select_from(Job)
                                .where(Job.status.in_(("queued", "running")))
                            )
                        if not left:
                            break
                        time.sleep(0.1)
                # Its connections closed: a backend that ends reports its counters
                # then, where an idle one may hold them past the phase's end. Their CPU
                # is read first.
                ended.update(postgres_cpu_s(admin, database))
                worker.recorder.sessions.kw["bind"].dispose()

            measured("run", running)
            measured("poll", lambda: poll(api.base, token, ids, clients))
        with sessions() as session:
            batches = len(set(session.scalars(select(Job.batch_id).where(Job.id.in_(ids)))))
        engine.dispose()
        admin.dispose()
        client.close()
        enqueue = enqueue_costs(redis_url, ENQUEUE_GROUPS, ENQUEUE_TENANTS, enqueue_messages)
    return {"jobs": len(ids), "batches": batches, "phases": phases, "enqueue": enqueue}


def add_history(engine: Engine, key_id: str, jobs: int) -> None:
    """``jobs`` finished jobs of ``key_id`` from the past day, analyzed: the table a
    deployment holds within its retention (``FERRY_RESULT_TTL_S``), whose size decides
    the plans the hot path's statements get (on a table of a few thousand rows a look
    at every row is cheaper than the index, and the planner takes it)."""
    if jobs > 0:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, api_key_id, model, priority, status, input, output, "
                    "cost, attempts, created_at, started_at, finished_at, batch_id, batch_size) "
                    "SELECT 'history-' || n, :key, 'sim', 'normal', 'succeeded', "
                    "'{\"cost\": 8}'::json, '{\"cost\": 8}'::json, 8, 1, t, t, t, "
                    "'history-batch-' || n / 32, 32 "
                    "FROM generate_series(1, :jobs) AS n, "
                    "LATERAL (SELECT now() - n * interval '1 day' / :jobs AS t) AS at"
                ),
                {"key": key_id, "jobs": jobs},
            )
    analyze(engine)


def analyze(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))


def enqueue_costs(
    redis_url: str, groups: tuple[int, ...], tenants: int, messages: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Redis's CPU and commands per job to enqueue ``messages`` jobs, in pipelines of one
    group commit's size, from ``tenants`` API keys: a script call per job (``enqueue``)
    against one per tenant's stream in the group (``enqueue_all``), side by side."""
    client = redis.Redis.from_url(redis_url)
    scripts = Scripts(client)
    found: dict[str, dict[str, dict[str, float]]] = {}
    for size in groups:
        for mode in ("enqueue", "enqueue_all"):
            prefix = f"enqueue-{mode}-{size}"
            batch = [
                JobMessage(f"job-{n}", "normal", 8, 0, tenant=f"key-{n % tenants}")
                for n in range(messages)
            ]
            client.config_resetstat()
            info = client.info("cpu")
            before = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
            for start in range(0, messages, size):
                pipe = client.pipeline(transaction=False)
                group = batch[start : start + size]
                if mode == "enqueue":
                    for message in group:
                        scripts.enqueue(pipe, prefix, "sim", message)
                else:
                    scripts.enqueue_all(pipe, prefix, (("sim", m) for m in group))
                scripts.execute(pipe)
            info = client.info("all")
            cpu = float(info["used_cpu_sys"]) + float(info["used_cpu_user"]) - before
            calls = sum(
                stats["calls"]
                for name, stats in info.items()
                if name.startswith("cmdstat_")
                and name not in ("cmdstat_info", "cmdstat_config|resetstat")
            )
            found.setdefault(str(size), {})[mode] = {
                "redis_cpu_us": cpu / messages * 1e6,
                "redis_commands": calls / messages,
            }
            client.flushdb()
    client.close()
    return found


@dataclass
class PerJob:
    """What one job costs each shared part (bench/capacity.py's per_job), over the rounds."""

    redis_commands: Spread
    redis_bytes: Spread
    redis_cpu_us: Spread
    db_transactions: Spread
    db_rows_written: Spread
    db_statements_per_submission: Spread
    db_statements_per_batch: Spread
    postgres_cpu_us: Spread
    api_cpu_us_per_submission: Spread
    api_cpu_us_per_long_poll: Spread
    worker_cpu_us_per_job: Spread
    jobs_per_batch: Spread


@dataclass
class EnqueueCost:
    redis_cpu_us: Spread
    redis_commands: Spread


@dataclass
class EnqueueWays:
    enqueue: EnqueueCost  # a script call per job
    enqueue_all: EnqueueCost  # one per tenant's stream in the group


@dataclass
class Walls:
    """Jobs/s where each part saturates (one core each; the API's per process)."""

    redis: Spread
    postgres_one_core: Spread
    api_process: Spread
    worker_overhead: Spread


@dataclass
class Report:
    """bench/results/capacity.json besides its head (bench.report.typed reads it)."""

    # Each round's raw counters, by phase (Redis's per command among them): open-ended.
    runs: list[dict[str, Any]]
    per_job: PerJob
    enqueue: dict[int, EnqueueWays]  # by jobs per group
    walls_jobs_per_s: Walls


RESULT = Report


def per_job(run: dict[str, Any]) -> dict[str, float]:
    """A round's costs per job (and per batch where a batch is the unit)."""
    jobs, batches = run["jobs"], run["batches"]
    submit_, run_, poll_ = (run["phases"][name] for name in ("submit", "run", "poll"))
    both = {name: submit_[name] + run_[name] for name in submit_ if not name.startswith("redis:")}
    # PostgreSQL's CPU is read in clock ticks and Redis's less its idle rate: on a short
    # run (the smoke's) either can read zero. Under one tick (one microsecond) it counts
    # as one: the cost is then an upper bound, and the wall it sets a lower one.
    both["postgres_cpu_s"] = max(both["postgres_cpu_s"], 1.0 / TICKS)
    both["redis_cpu_s"] = max(both["redis_cpu_s"], 1e-6)
    return {
        "redis_commands": both["redis_commands"] / jobs,
        "redis_bytes": (both["redis_in_bytes"] + both["redis_out_bytes"]) / jobs,
        "redis_cpu_us": both["redis_cpu_s"] / jobs * 1e6,
        "db_transactions": both["db_transactions"] / jobs,
        "db_rows_written": both["db_rows_written"] / jobs,
        "db_statements_per_submission": submit_["db_statements"] / jobs,
        "db_statements_per_batch": run_["db_statements"] / batches,
        "postgres_cpu_us": both["postgres_cpu_s"] / jobs * 1e6,
        "api_cpu_us_per_submission": submit_["part_cpu_s"] / jobs * 1e6,
        "api_cpu_us_per_long_poll": poll_["part_cpu_s"] / jobs * 1e6,
        "worker_cpu_us_per_job": run_["part_cpu_s"] / jobs * 1e6,
        "jobs_per_batch": jobs / batches,
    }


def walls(costs: dict[str, float]) -> dict[str, float]:
    """Jobs per second at which each part is saturated: one core each (Redis runs its
    commands on one thread; PostgreSQL's cost is its CPU over all its processes)."""
    return {
        "redis": 1e6 / costs["redis_cpu_us"],
        "postgres_one_core": 1e6 / costs["postgres_cpu_us"],
        "api_process": 1e6 / costs["api_cpu_us_per_submission"],
        "worker_overhead": 1e6 / costs["worker_cpu_us_per_job"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enqueue-messages", type=int, default=8192)
    parser.add_argument(
        "--idle-s",
        type=float,
        default=3.0,
        help="seconds of doing nothing before each phase, whose cost is taken off it",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=100_000,
        help="finished jobs in the table before the round (a deployment's retention)",
    )
    parser.add_argument("--out", type=Path, default=results.RESULTS / "capacity.json")
    args = parser.parse_args(argv)
    head = results.provenance("capacity", argv)
    runs = results.repeated(
        args.rounds,
        lambda: one_round(
            args.jobs, args.batch, args.clients, args.enqueue_messages, args.idle_s, args.history
        ),
        lambda run: print({k: round(v, 2) for k, v in per_job(run).items()}, flush=True),
    )
    costs = [per_job(run) for run in runs]
    figures = {name: results.spread([cost[name] for cost in costs]) for name in costs[0]}
    saturation = [walls(cost) for cost in costs]
    enqueue = {
        size: {
            mode: {
                name: results.spread([run["enqueue"][size][mode][name] for run in runs])
                for name in ("redis_cpu_us", "redis_commands")
            }
            for mode in ("enqueue", "enqueue_all")
        }
        for size in runs[0]["enqueue"]
    }
    results.write(
        args.out,
        {
            "runs": runs,
            "per_job": figures,
            "enqueue": enqueue,
            "walls_jobs_per_s": {
                name: results.spread([found[name] for found in saturation])
                for name in saturation[0]
            },
        },
        settings={
            "jobs": args.jobs,
            "batch_max_size": args.batch,
            "clients": args.clients,
            "rounds": args.rounds,
            "database": "postgresql",
            "enqueue_groups": list(ENQUEUE_GROUPS),
            "enqueue_tenants": ENQUEUE_TENANTS,
            "enqueue_messages": args.enqueue_messages,
            "idle_s": args.idle_s,
            "history_jobs": args.history,
        },
        head=head,
    )
    print(f"wrote {args.out}")


# --- its tables (python -m bench.render) --------------------------------------------------

CAPACITY_ROWS = (
    ("Redis", "commands per job", "redis_commands", 1),
    ("Redis", "bytes in and out per job", "redis_bytes", 0),
    ("Redis", "CPU per job (µs)", "redis_cpu_us", 1),
    ("PostgreSQL", "transactions per job", "db_transactions", 2),
    ("PostgreSQL", "rows written per job", "db_rows_written", 2),
    ("PostgreSQL", "statements per submission", "db_statements_per_submission", 2),
    ("PostgreSQL", "statements per batch", "db_statements_per_batch", 1),
    ("PostgreSQL", "CPU per job, its backends (µs)", "postgres_cpu_us", 0),
    ("API", "CPU per submission (µs)", "api_cpu_us_per_submission", 0),
    ("API", "CPU per long-poll (µs)", "api_cpu_us_per_long_poll", 0),
    ("worker", "CPU per job outside the model (µs)", "worker_cpu_us_per_job", 0),
    ("worker", "jobs per batch", "jobs_per_batch", 1),
)


# What a deployment of 100 GPUs asks of the shared parts, at these jobs/s per GPU.
GPUS = 100


PER_GPU = (10, 100, 1000)


def _spread_text(found: Spread, digits: int) -> str:
    median, low, high = (f"{v:,.{digits}f}" for v in (found.median, found.min, found.max))
    return median if low == high else f"{median} ({low}–{high})"


def _history_text(settings: dict[str, Any]) -> str:
    history = settings.get("history_jobs", 0)
    return f" holding {history:,} finished jobs, analyzed" if history else ""


def render_capacity(results: Results) -> list[str]:
    doc, report = results["capacity"], results.typed("capacity", Report)
    settings = doc["settings"]
    costs, walls = report.per_job, report.walls_jobs_per_s
    lines = [
        f"{measured_on(doc)}: {settings['jobs']:,} sim jobs "
        f"from {settings['clients']} clients, batches of up to {settings['batch_max_size']}, "
        f"PostgreSQL{_history_text(settings)}; median of {settings['rounds']} rounds (range).",
        "",
        *table(
            ["part", "cost", "measured"],
            "llr",
            [
                [part, what, _spread_text(getattr(costs, key), digits)]
                for part, what, key, digits in CAPACITY_ROWS
            ],
        ),
        "",
        f"The enqueue alone, {settings['enqueue_messages']:,} jobs from "
        f"{settings['enqueue_tenants']} API keys in pipelines of one group commit's size: "
        "Redis's CPU (µs) and commands per job, a script call per job (`enqueue`) against "
        "one per tenant's stream in the group (`enqueue_all`, what Ferry does):",
        "",
        *table(
            ["jobs per group", "enqueue: µs", "commands", "enqueue_all: µs", "commands"],
            "rrrrr",
            [
                [
                    str(size),
                    _spread_text(ways.enqueue.redis_cpu_us, 1),
                    _spread_text(ways.enqueue.redis_commands, 2),
                    _spread_text(ways.enqueue_all.redis_cpu_us, 1),
                    _spread_text(ways.enqueue_all.redis_commands, 2),
                ]
                for size, ways in report.enqueue.items()
            ],
        ),
        "",
        "Where each part saturates (jobs/s; one core each: Redis runs its commands on one "
        "thread, PostgreSQL's figure is per core of its server, the API's per process), and "
        f"what {GPUS} GPUs finishing R jobs/s each ask of them:",
        "",
    ]
    redis_wall = walls.redis.median
    postgres_core = walls.postgres_one_core.median
    api_process = walls.api_process.median
    saturating = (walls.redis, walls.postgres_one_core, walls.api_process, walls.worker_overhead)
    rows = [["saturates at"] + [_spread_text(wall, 0) for wall in saturating]]
    for rate in PER_GPU:
        total = GPUS * rate
        rows.append(
            [
                f"{GPUS} GPUs × {rate:,} jobs/s",
                f"{total / redis_wall:.0%} of its core",
                f"{total / postgres_core:,.1f} cores",
                f"{math.ceil(total / api_process):,} processes",
                f"{rate / walls.worker_overhead.median:.1%} of a core per worker",
            ]
        )
    return [
        *lines,
        *table(["", "Redis", "PostgreSQL", "API", "worker (outside the model)"], "lrrrr", rows),
    ]


if __name__ == "__main__":
    main()
