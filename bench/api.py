# ruff: noqa: RUF001
"""The API's per-job path under load: Ferry's /v1/jobs against a bare FastAPI endpoint.

Four scenarios, each driven by ``wrk -t1 -c32`` (one thread, 32 keep-alive
connections, as fast as the server answers) for ``--duration`` seconds:

* **bare**: a FastAPI endpoint started by this bench in a uvicorn process of its
  own, with the settings Ferry's API runs uvicorn with (one process,
  ``log_config=None``, ``access_log=False``): it parses the body Ferry's
  ``POST /v1/jobs`` takes into a pydantic model of the same fields (model,
  input, priority) and answers 202 with a small JSON. The floor: the framework
  alone, no authentication, rate limit, database or Redis;
* **submit**: ``POST /v1/jobs`` to Ferry, ``{"model": "sim", "input": {"cost": 1},
  "priority": "normal"}``;
* **get**: ``GET /v1/jobs/{id}`` of one finished job;
* **submit+long-poll**: each request is a submission or a
  ``GET /v1/jobs/{id}?wait=10`` of a job submitted and not yet seen terminal
  (``bench/wrk/longpoll.lua``); a job counts once its GET answers a terminal
  status.

Ferry is a fresh ``ferry up`` per database and number of API processes
(``FERRY_MODELS=sim``: one sim worker drains the queue; a batch takes
5 ms + 0.1 ms per unit of cost, a fast GPU; the rate limit and the outstanding
job quota are raised out of the way; no Flower), on SQLite and on a scratch
database ``ferry_bench_<hex>`` of the PostgreSQL at 127.0.0.1:5432 (dropped
afterwards), with 1 and 2 API processes (``FERRY_API_PROCESSES``; where the
stack runs fewer API processes than asked for, the result says so). The bare
server runs throughout and is measured in every round beside the stack's
scenarios, while the stack idles.

Each stack is warmed up (each of its scenarios for ``--warmup`` seconds),
then runs ``--rounds`` rounds of bare, submit, get, submit+long-poll; after a
scenario that submits, the bench waits until the worker has finished every
job before the next. Per run: requests/s and jobs/s (2xx answers; for
submit+long-poll, jobs seen terminal), wrk's latency percentiles (p50/p99 of
every request), the responses by status (non-2xx and socket errors are
flagged), and CPU time per job of every process: the API process(es), the
worker, Redis, Celery, ``ferry up`` itself, the database's PostgreSQL
backends (and all of the server's processes), the bare server and wrk: the
change of utime + stime + cutime + cstime in /proc/<pid>/stat across the wrk
run (processes matched by pid and start time; one that starts meanwhile counts
all its time, one that ends meanwhile counts only through the cutime of the
one that reaps it), over the jobs done. Each figure is reported as the
median of the rounds and their range (min-max); the ratios (submit / bare
requests/s, submit+long-poll jobs/s / bare requests/s) are taken round by
round, each against the bare run of the same round.

    python -m bench.api [--duration 5] [--rounds 3] [--warmup 2]
                        [--databases sqlite,postgresql] [--api-processes 1,2]
                        [--connections 32] [--cost 1] [--priority normal] [--wait 10]
                        [--out bench/results/api.json]
    make bench-api      # the same, after installing wrk when it is missing

The defaults take about 7 minutes on 2 cores. Needs ``wrk`` (4.x, with its Lua
scripting) on the PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bench import results
from bench.report import (
    Figure,
    Fmt,
    Results,
    decimal,
    measured_on,
    table,
    times,
    verdict,
)
from bench.results import spread
from harness import webclient
from harness.processes import command_line
from harness.stack import FerryUp

SCENARIOS = ("bare", "submit", "get", "longpoll")
LABELS = {"bare": "bare", "submit": "submit", "get": "get", "longpoll": "submit+long-poll"}
TERMINAL = ("succeeded", "failed", "expired", "cancelled")
WRK_DIR = Path(__file__).resolve().parent / "wrk"
POSTGRES_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
# A fast GPU, as bench/pipeline.py's: 5 ms + 0.1 ms per unit of cost.
SIM = {"FERRY_SIM_LATENCY_BASE_MS": "5", "FERRY_SIM_LATENCY_PER_COST_MS": "0.1"}
# Out of the way: the bench measures the path, not the limits.
LIMITS = {"FERRY_RATE_LIMIT": "1000000/second", "FERRY_MAX_OUTSTANDING_JOBS": "100000000"}
# Roles of the processes whose CPU time is measured, in the order reported.
ROLES = (
    "api",
    "worker",
    "redis",
    "postgres",
    "celery",
    "supervisor",
    "postgres_all",
    "bare",
    "wrk",
)
# What the stack's CPU per job adds up (postgres_all is the whole server, shared).
STACK_ROLES = ("api", "worker", "redis", "postgres", "celery", "supervisor")
CLOCK_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
# A pause after the bench's own database queries, before the next run.
SETTLE_S = 1.0


# --- The bare endpoint ------------------------------------------------------


class BareJob(BaseModel):
    """The fields of Ferry's JobCreate that a submission of the bench sends."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=64)
    input: Any
    priority: Literal["urgent", "vip", "normal", "bulk"] = "normal"


def serve_bare(port: int) -> None:
    """The bare endpoint, with the uvicorn settings of ``ferry api`` (one process)."""
    import uuid

    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/jobs", status_code=202)
    async def create_job(body: BareJob) -> dict[str, str]:
        return {"id": uuid.uuid4().hex, "model": body.model, "status": "queued"}

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    uvicorn.Server(config).run()


# --- CPU time from /proc --------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start: int  # clock ticks after boot: with the pid, a process's identity
    ticks: int  # utime + stime + cutime + cstime
    comm: str
    cmdline: list[str]


def processes() -> dict[int, Proc]:
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        found[int(entry)] = Proc(
            pid=int(entry),
            ppid=int(fields[1]),
            start=int(fields[19]),
            ticks=sum(int(value) for value in fields[11:15]),
            comm=comm,
            cmdline=command_line(raw),
        )
    return found


def descendants(table: dict[int, Proc], root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return [pid for pid in found if pid in table]


def shown(cmdline: list[str]) -> str:
    """A process's command as the results file keeps it: the program by its name only
    (``python -m ferry api``), so no path of the machine it ran on is recorded."""
    if not cmdline:
        return ""
    return shlex.join([Path(cmdline[0]).name.rstrip("0123456789."), *cmdline[1:]])[:200]


def ferry_role(cmdline: list[str]) -> str:
    """What a child of ``ferry up`` is, from its command line."""
    if cmdline and Path(cmdline[0]).name.startswith("redis-server"):
        return "redis"
    if "ferry" in cmdline[:-1]:
        command = cmdline[cmdline.index("ferry") + 1]
        return {"api": "api", "worker": "worker", "celery": "celery"}.get(command, "other")
    return "other"


def stack_roles(table: dict[int, Proc], up_pid: int) -> dict[int, str]:
    """The role of every process of the ``ferry up`` tree; a descendant takes its branch's."""
    roles = {up_pid: "supervisor"} if up_pid in table else {}
    for pid in descendants(table, up_pid):
        if pid == up_pid:
            continue
        branch = pid
        while table[branch].ppid != up_pid:
            branch = table[branch].ppid
        roles[pid] = ferry_role(table[branch].cmdline)
    return roles


@dataclass
class Watched:
    """The processes measured: a ``ferry up`` tree, PostgreSQL, the bare server."""

    up_pid: int | None = None
    bare_pid: int | None = None
    database: str | None = None  # the PostgreSQL database whose backends count as "postgres"

    def snapshot(self) -> dict[tuple[int, int], tuple[str, int, str]]:
        """(pid, start) -> (role, CPU ticks, command) of every watched process, now."""
        table = processes()
        roles = stack_roles(table, self.up_pid) if self.up_pid else {}
        if self.bare_pid in table:
            roles[self.bare_pid] = "bare"
        seen: dict[tuple[int, int], tuple[str, int, str]] = {}
        for pid, role in roles.items():
            proc = table[pid]
            seen[(pid, proc.start)] = (role, proc.ticks, shown(proc.cmdline))
        for proc in table.values():
            if proc.comm != "postgres" or (proc.pid, proc.start) in seen:
                continue
            command = " ".join(proc.cmdline)
            mine = self.database is not None and f" {self.database} " in f"{command} "
            # A backend of the bench's database counts under both names.
            seen[(proc.pid, proc.start)] = ("postgres_all", proc.ticks, command[:200])
            if mine:
                seen[(-proc.pid, proc.start)] = ("postgres", proc.ticks, command[:200])
        return seen


@dataclass
class CpuDelta:
    ms: dict[str, float]  # role -> CPU milliseconds over the run
    by_process: list[dict[str, Any]]  # role, pid, command, ms: for roles with several


def cpu_delta(
    before: dict[tuple[int, int], tuple[str, int, str]],
    after: dict[tuple[int, int], tuple[str, int, str]],
) -> CpuDelta:
    """CPU per role between two snapshots.

    A process that started meanwhile counts all its time; one that ended
    meanwhile counts nothing (what it spent in the run is lost, the one that
    reaped it counts its whole life in its cutime).
    """
    ms = dict.fromkeys(ROLES, 0.0)
    by_process = []
    for key, (role, end, command) in after.items():
        spent = end - before[key][1] if key in before else end
        ms[role] = ms.get(role, 0.0) + spent * CLOCK_TICK_MS
        if role in ("api", "worker") and spent:
            by_process.append(
                {"role": role, "pid": abs(key[0]), "command": command, "ms": spent * CLOCK_TICK_MS}
            )
    by_process.sort(key=lambda p: (p["role"], p["pid"]))
    return CpuDelta(ms={k: round(v, 1) for k, v in ms.items()}, by_process=by_process)


# --- wrk ----------------------------------------------------------------------


@dataclass
class Run:
    """One wrk run."""

    round: int
    seconds: float
    requests: int
    requests_per_s: float
    jobs: int  # 2xx answers; for longpoll, jobs seen terminal
    jobs_per_s: float
    latency_ms: dict[str, float]  # wrk's: p50, p90, p99, max, mean over every request
    statuses: dict[str, int]
    non_2xx: int
    socket_errors: dict[str, int]  # connect, read, write, timeout
    cpu_ms: dict[str, float]  # per role, over the run
    cpu_ms_per_job: dict[str, float]
    cpu_by_process: list[dict[str, Any]]
    job_ms: dict[str, float | None] | None = None  # longpoll: server-side accepted -> finished
    backlog_at_end: int | None = None  # jobs queued or running when wrk stopped
    drain_s: float | None = None  # how long the worker took to finish them
    wrk_output: str = ""


def run_wrk(
    url: str,
    script: str,
    env: dict[str, str],
    duration_s: int,
    connections: int,
    watched: Watched,
    round_: int,
) -> Run:
    args = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{duration_s}s",
        "--timeout",
        "30s",
        "--latency",
        "-s",
        str(WRK_DIR / script),
        url,
    ]
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = watched.snapshot()
    done = subprocess.run(
        args,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=duration_s + 60,
        check=False,
    )
    after = watched.snapshot()
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((x for x in done.stdout.splitlines() if x.startswith("FERRY_WRK ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr}")
    summary = json.loads(line.removeprefix("FERRY_WRK "))
    cpu = cpu_delta(before, after)
    # wrk was the only child reaped meanwhile: RUSAGE_CHILDREN grew by its time.
    cpu.ms["wrk"] = round(
        1000.0
        * (
            children_after.ru_utime
            + children_after.ru_stime
            - children_before.ru_utime
            - children_before.ru_stime
        ),
        1,
    )
    seconds = summary["duration_us"] / 1e6
    statuses = {str(k): int(v) for k, v in sorted(summary["statuses"].items())}
    jobs = int(summary["completed"])
    latency = {k: round(float(v) / 1000.0, 2) for k, v in summary["latency_us"].items()}
    errors = summary["errors"]
    job_ms = summary["job_ms"]
    return Run(
        round=round_,
        seconds=round(seconds, 3),
        requests=int(summary["requests"]),
        requests_per_s=round(summary["requests"] / seconds, 1),
        jobs=jobs,
        jobs_per_s=round(jobs / seconds, 1),
        latency_ms=latency,
        statuses=statuses,
        non_2xx=sum(n for status, n in statuses.items() if not status.startswith("2")),
        socket_errors={k: int(errors[k]) for k in ("connect", "read", "write", "timeout")},
        cpu_ms=cpu.ms,
        cpu_ms_per_job={k: round(v / jobs, 3) if jobs else float("nan") for k, v in cpu.ms.items()},
        cpu_by_process=[
            {**p, "ms": round(p["ms"], 1), "ms_per_job": round(p["ms"] / jobs, 3) if jobs else None}
            for p in cpu.by_process
        ],
        job_ms=(
            {"count": job_ms["count"], "p50": job_ms["p50"], "p99": job_ms["p99"]}
            if script == "longpoll.lua"
            else None
        ),
        wrk_output="\n".join(x for x in done.stdout.splitlines() if x != line),
    )


# --- The stacks -----------------------------------------------------------------


def api_processes_supported() -> bool:
    from core.config.settings import Settings

    return "api_processes" in Settings.model_fields


def serving_api_processes(up_pid: int) -> list[Proc]:
    """The API processes that serve: the leaves of the API's branch of the tree."""
    table = processes()
    roles = stack_roles(table, up_pid)
    api = [table[pid] for pid, role in roles.items() if role == "api"]
    parents = {proc.ppid for proc in api}
    return [
        proc
        for proc in api
        if proc.pid not in parents and not any("resource_tracker" in a for a in proc.cmdline)
    ]


def outstanding(database_url: str) -> int:
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            query = "SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')"
            return int(conn.execute(sqlalchemy.text(query)).scalar_one())
    finally:
        engine.dispose()


def wait_drained(database_url: str, timeout_s: float) -> tuple[int, float]:
    """(jobs outstanding at first, seconds until none were)."""
    started = time.monotonic()
    first = left = outstanding(database_url)
    while left:
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{left} jobs still queued or running after {timeout_s:.0f} s")
        time.sleep(0.2)
        left = outstanding(database_url)
    return first, round(time.monotonic() - started, 2)


def finished_job(base: str, token: str, body: dict[str, Any]) -> str:
    """Submits one job and waits for it: its id (the job the ``get`` scenario reads)."""

    headers = {"Authorization": f"Bearer {token}"}
    with webclient.client(base_url=base, headers=headers, timeout=30) as client:
        response = client.post("/v1/jobs", json=body)
        if response.status_code != 202:
            raise RuntimeError(
                f"the submission was refused: {response.status_code} {response.text}"
            )
        job_id = str(response.json()["id"])
        until = time.monotonic() + 60
        while time.monotonic() < until:
            job = client.get(f"/v1/jobs/{job_id}", params={"wait": 10}).json()
            if job["status"] in TERMINAL:
                if job["status"] != "succeeded":
                    raise RuntimeError(f"the first job did not succeed: {job}")
                return job_id
    raise RuntimeError("the first job did not finish within 60 s")


def kill_leftovers(pids: dict[int, int]) -> None:
    """SIGKILL what is still alive of the processes a stack had (pid -> start time)."""
    table = processes()
    for pid, start in pids.items():
        if pid in table and table[pid].start == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Summary:
    """One scenario of one stack over the rounds: median and range."""

    requests_per_s: dict[str, float]  # median, min, max
    jobs_per_s: dict[str, float]
    p50_ms: dict[str, float]
    p99_ms: dict[str, float]
    cpu_ms_per_job: dict[str, dict[str, float]]  # role -> median, min, max
    non_2xx: int  # over all rounds
    socket_errors: int


@dataclass
class StackResult:
    database: str
    api_processes_asked: int
    api_processes: int
    api_processes_note: str
    api_commands: list[str]
    # working_tree() when the stack started: stacks with different ones ran different code.
    working_tree: str = ""
    scenarios: dict[str, list[Run]] = field(default_factory=dict)
    summary: dict[str, Summary] = field(default_factory=dict)
    # Round by round against the bare run of the same round: median, min, max.
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Report:
    """bench/results/api.json besides its head (bench.report.typed reads it)."""

    elapsed_s: float
    flags: list[str]  # what makes a run's figures doubtful, said in the file
    stacks: list[StackResult]


RESULT = Report


def summarise(runs: list[Run]) -> Summary:
    return Summary(
        requests_per_s=spread([r.requests_per_s for r in runs]),
        jobs_per_s=spread([r.jobs_per_s for r in runs]),
        p50_ms=spread([r.latency_ms["p50"] for r in runs]),
        p99_ms=spread([r.latency_ms["p99"] for r in runs]),
        cpu_ms_per_job={role: spread([r.cpu_ms_per_job[role] for r in runs]) for role in ROLES},
        non_2xx=sum(r.non_2xx for r in runs),
        socket_errors=sum(sum(r.socket_errors.values()) for r in runs),
    )


@dataclass
class Options:
    duration_s: int
    rounds: int
    warmup_s: int
    connections: int
    body: dict[str, Any]
    wait_s: int
    drain_timeout_s: float


def run_stack(
    database: str,
    api_processes: int,
    options: Options,
    bare_url: str,
    watched: Watched,
    admin_url: str,
) -> StackResult:
    with contextlib.ExitStack() as scope:
        settings = {
            "FERRY_MODELS": "sim",
            "FERRY_FLOWER_PORT": "0",
            "FERRY_API_SHUTDOWN_DELAY_S": "0",
            "FERRY_API_PROCESSES": str(api_processes),
            **LIMITS,
            **SIM,
        }
        watched.database = None
        if database == "postgresql":
            from sqlalchemy.engine import make_url

            from harness.services import postgres_database

            url = scope.enter_context(postgres_database(admin_url))
            settings["FERRY_DATABASE_URL"] = url
            watched.database = make_url(url).database
        root = Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="ferry-bench-api-")))
        return _measure_stack(database, api_processes, options, bare_url, watched, root, settings)


def _measure_stack(
    database: str,
    api_processes: int,
    options: Options,
    bare_url: str,
    watched: Watched,
    root: Path,
    settings: dict[str, str],
) -> StackResult:
    stack = FerryUp(root, celery=False, **settings)
    try:
        stack.start(timeout_s=180)
        assert stack.process is not None
        up_pid = stack.process.pid
        watched.up_pid = up_pid
        body = json.dumps(options.body)
        job_id = finished_job(stack.base, stack.token, options.body)
        serving = serving_api_processes(up_pid)
        until = time.monotonic() + 10
        while len(serving) < api_processes and time.monotonic() < until:
            time.sleep(0.5)
            serving = serving_api_processes(up_pid)
        # Fewer API processes than asked for: this `ferry up` does not act on the
        # setting (yet); the figures are those of the processes that ran.
        note = "setting not supported" if len(serving) < api_processes else ""
        result = StackResult(
            database=database,
            api_processes_asked=api_processes,
            api_processes=len(serving),
            api_processes_note=note,
            api_commands=[shown(p.cmdline) for p in serving],
            working_tree=working_tree()[:12],
        )
        label = f"{database}, {len(serving)} API process{'es' if len(serving) > 1 else ''}"
        print(f"{label}{f' ({note})' if note else ''}: up, {stack.base}", flush=True)
        token = {"FERRY_BENCH_TOKEN": stack.token}
        scripts: dict[str, tuple[str, str, dict[str, str]]] = {
            "bare": (
                bare_url,
                "request.lua",
                {
                    "FERRY_BENCH_METHOD": "POST",
                    "FERRY_BENCH_PATH": "/v1/jobs",
                    "FERRY_BENCH_BODY": body,
                },
            ),
            "submit": (
                stack.base,
                "request.lua",
                {
                    **token,
                    "FERRY_BENCH_METHOD": "POST",
                    "FERRY_BENCH_PATH": "/v1/jobs",
                    "FERRY_BENCH_BODY": body,
                },
            ),
            "get": (
                stack.base,
                "request.lua",
                {**token, "FERRY_BENCH_METHOD": "GET", "FERRY_BENCH_PATH": f"/v1/jobs/{job_id}"},
            ),
            "longpoll": (
                stack.base,
                "longpoll.lua",
                {**token, "FERRY_BENCH_BODY": body, "FERRY_BENCH_WAIT": str(options.wait_s)},
            ),
        }
        database_url = stack.env["FERRY_DATABASE_URL"]

        def run(scenario: str, seconds: int, round_: int) -> Run:
            url, script, env = scripts[scenario]
            measured = run_wrk(url, script, env, seconds, options.connections, watched, round_)
            if scenario in ("submit", "longpoll"):
                measured.backlog_at_end, measured.drain_s = wait_drained(
                    database_url, options.drain_timeout_s
                )
                time.sleep(SETTLE_S)  # the check's own database backend gone
            return measured

        if options.warmup_s:
            for scenario in ("submit", "longpoll", "get"):
                run(scenario, options.warmup_s, 0)
        for round_ in range(1, options.rounds + 1):
            for scenario in SCENARIOS:
                measured = run(scenario, options.duration_s, round_)
                result.scenarios.setdefault(scenario, []).append(measured)
                print(f"  round {round_} {LABELS[scenario]:17} {_line(measured)}", flush=True)
        return result
    finally:
        stop_stack(stack, watched)


def stop_stack(stack: FerryUp, watched: Watched) -> None:
    """Stop ``ferry up``, then SIGKILL whatever of its process tree outlived it."""
    watched.up_pid = None
    members: dict[int, int] = {}
    if stack.process is not None:
        table = processes()
        members = {pid: table[pid].start for pid in descendants(table, stack.process.pid)}
    stack.stop(stack.process, 120)
    kill_leftovers(members)


def add_summaries(result: StackResult) -> None:
    for scenario, runs in result.scenarios.items():
        result.summary[scenario] = summarise(runs)
    bare = {r.round: r for r in result.scenarios.get("bare", [])}

    def against_bare(scenario: str, value: str) -> dict[str, float]:
        ratios = [
            getattr(r, value) / bare[r.round].requests_per_s
            for r in result.scenarios.get(scenario, [])
            if r.round in bare and bare[r.round].requests_per_s
        ]
        return spread(ratios)

    result.ratios = {
        "submit_per_bare": against_bare("submit", "requests_per_s"),
        "longpoll_jobs_per_bare": against_bare("longpoll", "jobs_per_s"),
        "get_per_bare": against_bare("get", "requests_per_s"),
    }
    if "submit" in result.summary:
        result.ratios["api_cpu_ms_per_submission"] = result.summary["submit"].cpu_ms_per_job["api"]
    if "longpoll" in result.summary:
        result.ratios["api_cpu_ms_per_longpoll_job"] = result.summary["longpoll"].cpu_ms_per_job[
            "api"
        ]


# --- The report ---------------------------------------------------------------------


def provenance(bench: str, argv: list[str] | None) -> dict[str, Any]:
    """bench.results' head, with the wrk that loaded the stacks and a place to say whether
    the code changed while they ran."""
    head = results.provenance(bench, argv)
    head["git"]["working_tree_changed_during_run"] = False
    head["machine"]["wrk"] = _command_output(["wrk", "--version"]).splitlines()[0:1]
    return head


def working_tree() -> str:
    """A fingerprint of the code as it is now: HEAD, the diff to it, the untracked files."""
    import hashlib

    digest = hashlib.sha256(_command_output(["git", "rev-parse", "HEAD"]).encode())
    digest.update(_command_output(["git", "diff", "HEAD", "--", ".", ":!bench/results"]).encode())
    untracked = _command_output(["git", "ls-files", "--others", "--exclude-standard"])
    for name in sorted(untracked.splitlines()):
        if not name.startswith("bench/results/"):
            with contextlib.suppress(OSError):
                digest.update(name.encode() + Path(name).read_bytes())
    return digest.hexdigest()


def _command_output(args: list[str]) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout + done.stderr).rstrip()


def _line(r: Run) -> str:
    flags = ""
    if r.non_2xx or any(r.socket_errors.values()):
        bad = {k: v for k, v in r.statuses.items() if not k.startswith("2")}
        flags = f"  !! non-2xx {bad} socket errors {r.socket_errors}"
    return (
        f"{r.requests_per_s:8.1f} req/s {r.jobs_per_s:8.1f} jobs/s  "
        f"p50 {r.latency_ms['p50']:6.1f} ms  p99 {r.latency_ms['p99']:6.1f} ms  "
        f"api {r.cpu_ms_per_job['api']:.2f} ms/job{flags}"
    )


def _range(figure: dict[str, float], digits: int = 0) -> str:
    return f"{figure['median']:.{digits}f} ({figure['min']:.{digits}f}-{figure['max']:.{digits}f})"


def _job_ms(result: StackResult) -> str:
    """Long-poll jobs' accepted -> finished (the API's timings): median p50 / p99 of the rounds."""
    runs = [r.job_ms for r in result.scenarios.get("longpoll", []) if r.job_ms]
    p50 = [float(j["p50"]) for j in runs if j["p50"] is not None]
    p99 = [float(j["p99"]) for j in runs if j["p99"] is not None]
    if not p50 or not p99:
        return "-"
    return f"{statistics.median(p50):.0f} / {statistics.median(p99):.0f}"


def _processes(result: StackResult) -> str:
    """API processes that ran; "2>1" where 2 were asked for and 1 ran."""
    if result.api_processes == result.api_processes_asked:
        return str(result.api_processes)
    return f"{result.api_processes_asked}>{result.api_processes}"


def print_tables(results: list[StackResult]) -> None:
    print(
        "\nmedian of the rounds (min-max); CPU in ms per job (for bare: the bare server's; "
        "stack = api + worker + redis + postgres + celery + ferry up)"
    )
    header = (
        f"{'database':10} {'api':>4} {'scenario':17} {'req/s':>22} {'jobs/s':>22} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'non2xx':>6} {'api':>6} {'worker':>6} {'redis':>6} "
        f"{'pg':>6} {'stack':>6} {'wrk':>6}"
    )
    print(header)
    for result in results:
        if result.error:
            print(f"{result.database:10} {result.api_processes_asked:>4} failed: {result.error}")
            continue
        for scenario, s in result.summary.items():
            cpu = {role: s.cpu_ms_per_job[role]["median"] for role in ROLES}
            stack_cpu = statistics.median(
                sum(r.cpu_ms_per_job[role] for role in STACK_ROLES)
                for r in result.scenarios[scenario]
            )
            errors = s.non_2xx + s.socket_errors
            # The stack idles while the bare server is measured: its figures there are left out.
            cells: list[float | None] = (
                [cpu["bare"], None, None, None, None]
                if scenario == "bare"
                else [cpu["api"], cpu["worker"], cpu["redis"], cpu["postgres"], stack_cpu]
            )
            if result.database != "postgresql":
                cells[3] = None
            print(
                f"{result.database:10} {_processes(result):>4} {LABELS[scenario]:17} "
                f"{_range(s.requests_per_s):>22} {_range(s.jobs_per_s):>22} "
                f"{s.p50_ms['median']:7.1f} {s.p99_ms['median']:7.1f} "
                f"{errors:>6}{'!' if errors else ' '}"
                + " ".join(f"{'-':>6}" if c is None else f"{c:6.2f}" for c in cells)
                + f" {cpu['wrk']:6.2f}"
            )
    print(
        "\nratios, round by round against the same round's bare run: median (min-max); "
        "long-poll job ms: accepted -> finished, p50 / p99"
    )
    print(
        f"{'database':10} {'api':>4} {'submit / bare':>20} {'long-poll jobs / bare':>22} "
        f"{'API CPU ms / submission':>24} {'per long-poll job':>20} {'long-poll job ms':>17}"
    )
    for result in results:
        if result.error or not result.ratios:
            continue
        r = result.ratios
        print(
            f"{result.database:10} {_processes(result):>4} "
            f"{_range(r['submit_per_bare'], 3):>20} {_range(r['longpoll_jobs_per_bare'], 3):>22} "
            f"{_range(r['api_cpu_ms_per_submission'], 2):>24} "
            f"{_range(r['api_cpu_ms_per_longpoll_job'], 2):>20} {_job_ms(result):>17}"
        )
    for result in results:
        if result.api_processes_note:
            print(
                f"note: {result.database}, {result.api_processes_asked} API processes asked for: "
                f"api_processes: {result.api_processes} ({result.api_processes_note})"
            )


def flags(results: list[StackResult]) -> list[str]:
    found = []
    for result in results:
        where = f"{result.database}, {result.api_processes} API"
        if result.error:
            found.append(f"{where}: failed: {result.error}")
        for scenario, runs in result.scenarios.items():
            for r in runs:
                bad = {k: v for k, v in r.statuses.items() if not k.startswith("2")}
                errors = {k: v for k, v in r.socket_errors.items() if v}
                if bad or errors:
                    found.append(
                        f"{where}, {LABELS[scenario]}, round {r.round}: "
                        f"non-2xx {bad or 0}, socket errors {errors or 0}"
                    )
    return found


@contextlib.contextmanager
def bare_server() -> Iterator[tuple[str, int]]:
    from ferry.local_redis import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.api", "--serve-bare", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        import httpx

        until = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                error = process.stderr.read() if process.stderr else ""
                raise RuntimeError(f"the bare server exited: {error[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                webclient.get(f"http://127.0.0.1:{port}/docs", timeout=2)
                break
            if time.monotonic() > until:
                raise RuntimeError("the bare server did not answer within 60 s")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds of each wrk run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="seconds per scenario, per stack")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--api-processes", default="1,2")
    parser.add_argument("--cost", type=int, default=1, help="the sim jobs' cost")
    parser.add_argument("--priority", default="normal", help="the jobs' lane")
    parser.add_argument("--wait", type=int, default=10, help="seconds a long-poll waits at most")
    parser.add_argument("--postgres-url", default=POSTGRES_ADMIN_URL, help="an admin URL")
    parser.add_argument("--out", type=Path, default=Path("bench/results/api.json"))
    parser.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bare:
        serve_bare(args.serve_bare)
        return 0
    if shutil.which("wrk") is None:
        print("wrk is not on the PATH (apt-get install -y wrk)", file=sys.stderr)
        return 2

    started = time.monotonic()
    options = Options(
        duration_s=args.duration,
        rounds=args.rounds,
        warmup_s=args.warmup,
        connections=args.connections,
        body={"model": "sim", "input": {"cost": args.cost}, "priority": args.priority},
        wait_s=args.wait,
        drain_timeout_s=180.0,
    )
    head = provenance("api", argv)
    settings = {
        "wrk": f"wrk -t1 -c{args.connections} -d{args.duration}s --timeout 30s --latency",
        **{k: v for k, v in asdict(options).items() if k != "drain_timeout_s"},
        "databases": args.databases.split(","),
        "api_processes": [int(n) for n in args.api_processes.split(",")],
        "ferry": {"FERRY_MODELS": "sim", "FERRY_FLOWER_PORT": "0", **LIMITS, **SIM},
        # Whether core.config.settings has FERRY_API_PROCESSES (`ferry up` may still ignore it).
        "api_processes_setting_known": api_processes_supported(),
    }
    report: dict[str, Any] = {}
    tree_at_start = working_tree()
    stacks: list[StackResult] = []
    watched = Watched()
    with bare_server() as (bare_url, bare_pid):
        watched.bare_pid = bare_pid
        # The bare server's first requests (imports, first parse) out of the way.
        run_wrk(
            bare_url,
            "request.lua",
            {
                "FERRY_BENCH_METHOD": "POST",
                "FERRY_BENCH_PATH": "/v1/jobs",
                "FERRY_BENCH_BODY": json.dumps(options.body),
            },
            1,
            args.connections,
            watched,
            0,
        )
        for database in args.databases.split(","):
            for count in (int(n) for n in args.api_processes.split(",")):
                try:
                    result = run_stack(
                        database, count, options, bare_url, watched, args.postgres_url
                    )
                except Exception as exc:  # one stack failing leaves the others' figures
                    print(f"{database}, {count} API processes: failed: {exc}", flush=True)
                    result = StackResult(database, count, 0, "", [], error=str(exc)[-2000:])
                add_summaries(result)
                stacks.append(result)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["flags"] = flags(stacks)
    if working_tree() != tree_at_start:
        # Others edited the code meanwhile: the stacks may not have run the same code.
        head["git"]["working_tree_changed_during_run"] = True
        trees = ", ".join(f"{r.database}/{r.api_processes_asked}: {r.working_tree}" for r in stacks)
        report["flags"].append(f"the working tree changed during the run (at each start: {trees})")
    report["stacks"] = [asdict(r) for r in stacks]
    print_tables(stacks)
    for flag in report["flags"]:
        print(f"FLAG: {flag}")
    results.write(args.out, report, settings=settings, head=head)
    print(f"wrote {args.out} ({report['elapsed_s']:.0f} s)")
    return 1 if any(r.error for r in stacks) else 0


# --- its tables (python -m bench.render) --------------------------------------------------


def _stack_label(stack: StackResult) -> str:
    database = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}[stack.database]
    count = stack.api_processes
    return f"{database}, {count} API process" + ("es" if count > 1 else "")


def render_api(results: Results) -> list[str]:
    doc, report = results["api"], results.typed("api", Report)
    stacks = [s for s in report.stacks if not s.error]
    rounds = doc["settings"]["rounds"]
    lines = [
        f"{measured_on(doc)}; median of {rounds} rounds (min–max):",
        "",
    ]

    def cells(get: Callable[[dict[str, Summary]], Mapping[str, float]], fmt: Fmt) -> list[str]:
        return [Figure.summary(get(s.summary)).text(fmt) for s in stacks]

    rows = [
        ["bare endpoint, requests/s", *cells(lambda s: s["bare"].requests_per_s, decimal())],
        [
            "bare endpoint, CPU per request, ms",
            *cells(lambda s: s["bare"].cpu_ms_per_job["bare"], decimal(2)),
        ],
        ["submit, requests/s", *cells(lambda s: s["submit"].requests_per_s, decimal())],
        ["get, requests/s", *cells(lambda s: s["get"].requests_per_s, decimal())],
        ["submit + long-poll, jobs/s", *cells(lambda s: s["longpoll"].jobs_per_s, decimal())],
        [
            "API CPU per submission, ms",
            *cells(lambda s: s["submit"].cpu_ms_per_job["api"], decimal(2)),
        ],
        ["API CPU per GET, ms", *cells(lambda s: s["get"].cpu_ms_per_job["api"], decimal(2))],
        [
            "API CPU per submitted and long-polled job, ms",
            *cells(lambda s: s["longpoll"].cpu_ms_per_job["api"], decimal(2)),
        ],
        [
            "worker CPU per sim job (submit run), ms",
            *cells(lambda s: s["submit"].cpu_ms_per_job["worker"], decimal(2)),
        ],
        [
            "database CPU per submission, ms",
            *cells(lambda s: s["submit"].cpu_ms_per_job["postgres_all"], decimal(2)),
        ],
    ]
    return lines + table(["", *map(_stack_label, stacks)], "l" + "r" * len(stacks), rows)


def render_api_targets(results: Results) -> list[str]:
    rows = []
    for stack in results.typed("api", Report).stacks:
        if stack.error or stack.api_processes != 1:
            continue
        ratios = stack.ratios
        for key, what, target, at_least, fmt in (
            ("submit_per_bare", "submit, × the bare endpoint", 0.5, True, times()),
            ("longpoll_jobs_per_bare", "submit + long-poll, × bare", 0.3, True, times()),
            ("api_cpu_ms_per_submission", "API CPU per submission", 1.5, False, decimal(2, " ms")),
        ):
            figure = Figure.summary(ratios[key])
            rows.append(
                [
                    f"{what} ({_stack_label(stack)})",
                    figure.text(fmt),
                    fmt(target),
                    verdict(figure.meets(target, at_least)),
                ]
            )
    return table(["figure", "value", "target", "met"], "lrrl", rows)


def headline_api(results: Results) -> str:
    doc, report = results["api"], results.typed("api", Report)
    sqlite = [s for s in report.stacks if s.database == "sqlite" and not s.error]
    one = next(s for s in sqlite if s.api_processes == 1)
    two = next((s for s in sqlite if s.api_processes == 2), None)
    submit, gets = one.summary["submit"], one.summary["get"]
    ratio = Figure.summary(one.ratios["submit_per_bare"])
    with_two = (
        f" ({Figure.summary(two.summary['get'].requests_per_s).text(decimal())} with two processes)"
        if two
        else ""
    )
    return (
        f"- **The API**, one process under `wrk` with {doc['settings']['connections']} "
        f"connections, takes {Figure.summary(submit.requests_per_s).text(decimal(), True)} "
        "submissions/s at "
        f"{Figure.summary(submit.cpu_ms_per_job['api']).text(decimal(2, ' ms'), True)} of "
        f"API CPU each and answers {Figure.summary(gets.requests_per_s).text(decimal(), True)}"
        f" GETs/s{with_two}: {ratio.text(times())} a bare FastAPI endpoint (target 0.5×: "
        f"{verdict(ratio.meets(0.5, True))})."
    )


if __name__ == "__main__":
    raise SystemExit(main())
