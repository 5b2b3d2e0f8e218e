# ruff: noqa: RUF001
"""Closed-loop clients end to end: minilm through ``ferry up`` against the raw model.

The figure asked for: minilm, 64 closed-loop clients, inputs of mixed length
from the benchmark corpus, as a share of the raw model ceiling measured in the
same run (the target: at least 80 %). In one run:

* **raw ceiling**: the minilm runtime alone in this process (no queue, no
  database, no HTTP), as ``bench/e2e.py`` takes it: the sample of texts
  (``--texts``: the first 1,000 of the corpus, ``bench/corpus.py``, which is
  shuffled with seed 0) sorted by token count, one pass through them per
  batch size (``--raw-sizes``), with PyTorch's intra-op threads set to each
  of ``--threads`` (``torch.set_num_threads``; 2 is every core of a 2-core
  machine). Each thread count's best batch size is reported; the **ceiling**
  is the best of them all, the machine's best. After the stacks, the
  ceiling's configuration is timed again (one pass) to show how much the
  machine drifted meanwhile; the ratios stay against the first measurement.
  Each pass also records the share of the cores that other processes took
  meanwhile (from /proc/stat, less this process's own CPU time).
* **Ferry**, one fresh ``ferry up`` per value of ``--threads``
  (``FERRY_CPU_THREADS``, the threads the worker's model uses on the CPU):
  ``FERRY_MODELS=minilm``, no Flower, the rate limit and the outstanding-job
  quota raised out of the way (``bench/api.py``'s ``LIMITS``), SQLite, every
  other setting at its default. ``wrk -t1 -c64`` with ``bench/wrk/clients.lua``
  is 64 closed-loop clients: each submits ``POST /v1/jobs {"model": "minilm",
  "input": <text>}`` (the sample's texts in turn, JSON-encoded here, one body
  a line in a file the script reads at init), long-polls ``GET
  /v1/jobs/{id}?wait=30`` until the job is terminal, then submits the next.
  A first job (the model's load), then a warm-up run (``--warmup`` s), then
  ``--rounds`` runs of ``--duration`` s; after each, the bench waits until
  the worker has finished what the clients left in flight.

Per round: **jobs/s** = jobs seen terminal / wrk's duration (a round starts
with no job in flight and stops with up to 64 unfinished, which are not
counted: at most one batch's worth of undercount); the **ratio** jobs/s ÷
the ceiling; p50 / p99 of the jobs' ``timings.total_ms`` (accepted →
finished, the API's own); the mean batch size, from each terminal job's
``batch.size`` (per batch: jobs / Σ jobs_s / s over sizes s; and per job);
the responses by status (non-2xx and socket errors are flagged); CPU ms per
job of each process (API, worker, Redis, Celery, ``ferry up``, wrk:
``bench/api.py``'s accounting, from /proc), and the CPU time of the whole
machine not spent by those nor this bench (other tenants: the run's noise).
Each figure is given as the median of the rounds and their range (min-max);
the best thread count is the one with the highest median ratio.

    python -m bench.clients [--duration 20] [--rounds 3] [--warmup 10]
                            [--clients 64] [--threads 1,2] [--texts 1000]
                            [--raw-sizes 16,32,64] [--wait 30]
                            [--quiet-below 1.5] [--quiet-timeout 2400]
                            [--set FERRY_NAME=VALUE ...] [--out bench/results/clients.json]
    make bench-clients  # the same, after installing wrk when it is missing

``--quiet-below L`` first waits (polling every 30 s, at most
``--quiet-timeout`` s) until the 1-minute load average has been below L at two
polls in a row; the run goes ahead (flagged) if it never is. The defaults take
about 8 minutes on 2 cores, plus the wait. Needs ``wrk`` (4.x, with its Lua
scripting) on the PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from bench import results
from bench.api import (
    CLOCK_TICK_MS,
    LIMITS,
    STACK_ROLES,
    Run,
    Watched,
    finished_job,
    processes,
    provenance,
    run_wrk,
    spread,
    stack_roles,
    stop_stack,
    wait_drained,
    working_tree,
)
from bench.quantiles import nearest_rank
from bench.report import Figure, Results, Spread, decimal, measured_on, percent, table, verdict
from harness.stack import FerryUp

MODEL = "minilm"
# The processes whose CPU per job is reported, as bench/api.py names them
# ("supervisor" is `ferry up` itself).
CPU_ROLES = ("api", "worker", "redis", "celery", "supervisor", "wrk")
DRAIN_TIMEOUT_S = 180.0
SETTLE_S = 1.0  # after the drain check's own database queries
QUIET_POLL_S = 30.0


# --- The raw ceiling ------------------------------------------------------------------


@dataclass(frozen=True)
class Spent:
    """Over an interval (or at its start): the machine's busy CPU ms, this process's, wall s."""

    busy_ms: float
    own_ms: float
    wall_s: float


@dataclass
class Raw:
    """The model alone: texts/s per thread count and batch size, and the best."""

    texts: int
    tokens_mean: float
    by_threads: dict[int, dict[int, float]] = field(default_factory=dict)
    # The share of the machine's cores other processes took during each pass.
    others_by_threads: dict[int, dict[int, float]] = field(default_factory=dict)
    best_by_threads: dict[int, float] = field(default_factory=dict)
    ceiling: float = 0.0
    ceiling_threads: int = 0
    ceiling_batch: int = 0
    seconds: float = 0.0
    # The ceiling's configuration timed again after the stacks.
    again: float | None = None
    drift: float | None = None  # again / ceiling - 1
    again_others: float | None = None


class RawModel:
    """The minilm runtime, loaded once in this process."""

    def __init__(self, threads: int) -> None:
        from backends.catalog import load_runtime, repository_for
        from core.config.settings import Settings

        settings = Settings(device=os.environ.get("FERRY_DEVICE", "auto"), cpu_threads=threads)
        self.runtime = load_runtime(repository_for(settings)[MODEL], settings)

    def rate(self, ordered: list[str], size: int) -> float:
        started = time.perf_counter()
        for i in range(0, len(ordered), size):
            self.runtime.run(ordered[i : i + size])
        return len(ordered) / (time.perf_counter() - started)


def set_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


def measure_raw(
    model: RawModel, texts: list[str], costs: list[int], threads: list[int], sizes: list[int]
) -> Raw:
    started = time.monotonic()
    ordered = [t for _, t in sorted(zip(costs, texts, strict=True), key=lambda p: (p[0], p[1]))]
    raw = Raw(texts=len(texts), tokens_mean=round(statistics.fmean(costs), 1))
    for count in threads:
        set_threads(count)
        # The thread pool resized and the larger shapes seen once.
        middle = len(ordered) // 2
        model.runtime.run(ordered[middle : middle + max(sizes)])
        rates: dict[int, float] = {}
        others: dict[int, float] = {}
        for size in sizes:
            before = Spent(machine_busy_ms(), own_ms(), time.monotonic())
            rates[size] = round(model.rate(ordered, size), 1)
            others[size] = others_share(before)
            print(
                f"  raw model, {count} thread(s), batch {size:>3}: {rates[size]:7.1f} texts/s"
                f"  (others {100 * others[size]:.0f} % of the cores)",
                flush=True,
            )
        raw.by_threads[count] = rates
        raw.others_by_threads[count] = others
        raw.best_by_threads[count] = max(rates.values())
    raw.ceiling = max(raw.best_by_threads.values())
    raw.ceiling_threads = max(raw.best_by_threads, key=lambda c: raw.best_by_threads[c])
    rates = raw.by_threads[raw.ceiling_threads]
    raw.ceiling_batch = max(rates, key=lambda s: rates[s])
    raw.seconds = round(time.monotonic() - started, 1)
    set_threads(1)  # idle beside the stacks
    return raw


def raw_again(model: RawModel, raw: Raw, texts: list[str], costs: list[int]) -> None:
    ordered = [t for _, t in sorted(zip(costs, texts, strict=True), key=lambda p: (p[0], p[1]))]
    set_threads(raw.ceiling_threads)
    model.runtime.run(ordered[: raw.ceiling_batch])
    before = Spent(machine_busy_ms(), own_ms(), time.monotonic())
    raw.again = round(model.rate(ordered, raw.ceiling_batch), 1)
    raw.again_others = others_share(before)
    raw.drift = round(raw.again / raw.ceiling - 1, 4)
    set_threads(1)


# --- The machine's own CPU ------------------------------------------------------------


def machine_busy_ms() -> float:
    """CPU milliseconds the whole machine has been busy (all cores), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) * CLOCK_TICK_MS


def own_ms() -> float:
    """CPU milliseconds of this process so far (its children are wrk, counted apart)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return 1000.0 * (usage.ru_utime + usage.ru_stime)


def others_share(before: Spent) -> float:
    """The share of the cores that processes other than this one took since ``before``."""
    busy = machine_busy_ms() - before.busy_ms - (own_ms() - before.own_ms)
    wall_ms = 1000.0 * (time.monotonic() - before.wall_s)
    return round(max(0.0, busy) / (wall_ms * len(os.sched_getaffinity(0))), 4)


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def wait_quiet(below: float, timeout_s: float) -> dict[str, Any]:
    """Polls the 1-minute load average until it is below ``below`` twice in a row."""
    started = time.monotonic()
    polls: list[list[float]] = []
    quiet = 0
    while True:
        one = os.getloadavg()[0]
        polls.append([round(time.monotonic() - started, 1), round(one, 2)])
        quiet = quiet + 1 if one < below else 0
        print(f"  load average {one:.2f} ({'quiet' if one < below else 'busy'})", flush=True)
        if quiet >= 2:
            met = True
            break
        if time.monotonic() - started + QUIET_POLL_S > timeout_s:
            met = False
            break
        time.sleep(QUIET_POLL_S)
    return {
        "below": below,
        "timeout_s": timeout_s,
        "met": met,
        "waited_s": round(time.monotonic() - started, 1),
        "polls": polls,
    }


# --- Ferry ------------------------------------------------------------------------------


@dataclass
class Round:
    round: int
    body_offset: int  # the sample's text the round's first submission took
    seconds: float
    jobs: int  # seen terminal
    jobs_per_s: float
    ratio: float  # jobs_per_s / the raw ceiling
    submitted: int
    job_p50_ms: float | None  # timings.total_ms, accepted -> finished
    job_p99_ms: float | None
    job_mean_ms: float | None
    mean_batch_size: float | None  # per batch: jobs / sum(jobs_s / s)
    mean_batch_size_per_job: float | None  # the batch size a job ran in, averaged over jobs
    batch_sizes: dict[str, int]  # batch.size -> jobs seen terminal in a batch of that size
    states: dict[str, int]  # terminal status -> jobs seen in it
    cpu_ms_per_job: dict[str, float]  # CPU_ROLES, "stack" (api + worker + redis + celery + up)
    other_cpu_ms: float  # the machine's busy time that none of those nor this bench spent
    other_cpu_share: float  # of the machine's cores over the round
    load_average_at_end: list[float]
    run: Run  # bench/api.py's record of the wrk run


@dataclass
class StackSummary:
    """A stack's rounds: each figure's median and range (NaN: no round measured it)."""

    jobs_per_s: Spread
    ratio: Spread  # of the raw ceiling
    job_p50_ms: Spread
    job_p99_ms: Spread
    mean_batch_size: Spread
    mean_batch_size_per_job: Spread
    cpu_ms_per_job: dict[str, Spread]  # CPU_ROLES and "stack"
    other_cpu_share: Spread
    non_2xx: int  # over all rounds
    socket_errors: int
    jobs: int


@dataclass
class StackResult:
    cpu_threads: int
    settings: dict[str, str]
    working_tree: str = ""
    startup_s: float | None = None  # `ferry up` until the first job finished
    worker_os_threads: int | None = None  # after the warm-up
    warmup: Run | None = None
    rounds: list[Round] = field(default_factory=list)
    summary: StackSummary | None = None
    error: str | None = None


@dataclass
class Report:
    """bench/results/clients.json besides its head (bench.report.typed reads it)."""

    quiet_wait: Any  # how long the run waited for a quiet machine, or None
    load_average: dict[str, list[float]]  # at_start, at_end
    sample: dict[str, float]  # the corpus sample: texts, tokens mean, p50, max
    elapsed_s: float
    raw: Raw
    stacks: list[StackResult]
    best_cpu_threads: int | None
    ratios: dict[int, Spread]  # by FERRY_CPU_THREADS
    flags: list[str]


RESULT = Report


@dataclass
class Options:
    duration_s: int
    rounds: int
    warmup_s: int
    clients: int
    wait_s: int


def ferry_settings(threads: int, extra: dict[str, str]) -> dict[str, str]:
    return {
        "FERRY_MODELS": MODEL,
        "FERRY_FLOWER_PORT": "0",  # no Flower (core.config.settings has no FERRY_FLOWER_ENABLED)
        "FERRY_API_SHUTDOWN_DELAY_S": "0",
        "FERRY_CPU_THREADS": str(threads),
        **LIMITS,
        **extra,
    }


@dataclass
class Started:
    """A ``ferry up`` of this bench's, up with its model loaded."""

    stack: FerryUp
    watched: Watched
    startup_s: float  # `ferry up` until the first job finished


@contextlib.contextmanager
def started_ferry(
    settings: dict[str, str], first: dict[str, Any], prefix: str
) -> Iterator[Started]:
    """``ferry up`` with ``settings`` in a temporary folder, ``first`` submitted and finished
    (the model's load), stopped afterwards with whatever of its tree outlived it; an
    exception leaving it carries the stack's last output as a note."""
    watched = Watched()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        stack = FerryUp(Path(tmp), celery=False, **settings)
        started = time.monotonic()
        try:
            stack.start(timeout_s=180)
            assert stack.process is not None
            watched.up_pid = stack.process.pid
            finished_job(stack.base, stack.token, first)  # waits for the model's load
            yield Started(stack, watched, round(time.monotonic() - started, 1))
        except Exception as exc:
            if stack.output:
                exc.add_note("ferry up's last output:\n" + "".join(stack.output)[-3000:])
            raise
        finally:
            stop_stack(stack, watched)


def run_stack(
    threads: int,
    options: Options,
    bodies: Path,
    body_count: int,
    ceiling: float,
    extra: dict[str, str],
) -> StackResult:
    settings = ferry_settings(threads, extra)
    result = StackResult(cpu_threads=threads, settings=settings)
    first = json.loads(bodies.read_text().splitlines()[0])
    try:
        with started_ferry(settings, first, "ferry-bench-clients-") as up:
            stack, watched = up.stack, up.watched
            assert stack.process is not None
            result.working_tree = working_tree()[:12]
            result.startup_s = up.startup_s
            print(
                f"FERRY_CPU_THREADS={threads}: up, first job done after "
                f"{result.startup_s:.0f} s, {stack.base}",
                flush=True,
            )
            database_url = stack.env["FERRY_DATABASE_URL"]
            env = {
                "FERRY_BENCH_TOKEN": stack.token,
                "FERRY_BENCH_BODIES": str(bodies),
                "FERRY_BENCH_WAIT": str(options.wait_s),
            }
            offset = 0

            def drive(seconds: int, round_: int) -> tuple[Run, dict[str, Any], Spent]:
                """A wrk run, clients.lua's line, and the machine's busy, own CPU ms and wall s."""
                nonlocal offset
                busy, own, wall = machine_busy_ms(), own_ms(), time.monotonic()
                run = run_wrk(
                    stack.base,
                    "clients.lua",
                    {**env, "FERRY_BENCH_OFFSET": str(offset)},
                    seconds,
                    options.clients,
                    watched,
                    round_,
                )
                spent = Spent(machine_busy_ms() - busy, own_ms() - own, time.monotonic() - wall)
                extra_line = _clients_line(run)
                offset = (offset + int(extra_line["submitted"])) % body_count
                run.backlog_at_end, run.drain_s = wait_drained(database_url, DRAIN_TIMEOUT_S)
                time.sleep(SETTLE_S)
                return run, extra_line, spent

            if options.warmup_s:
                result.warmup, _, _ = drive(options.warmup_s, 0)
                print(f"  warm-up: {result.warmup.jobs_per_s:.1f} jobs/s", flush=True)
            result.worker_os_threads = _worker_os_threads(stack.process.pid)
            for round_ in range(1, options.rounds + 1):
                start_offset = offset
                run, extra_line, spent = drive(options.duration_s, round_)
                measured = make_round(round_, start_offset, run, extra_line, spent, ceiling)
                result.rounds.append(measured)
                print(f"  round {round_}: {_line(measured)}", flush=True)
            result.summary = summarise(result.rounds)
    except Exception as exc:  # one stack failing leaves the other's figures
        print(f"FERRY_CPU_THREADS={threads}: failed: {exc}", flush=True)
        result.error = "\n".join([str(exc)[-3000:], *getattr(exc, "__notes__", [])])
        if result.rounds:
            result.summary = summarise(result.rounds)
    return result


def _clients_line(run: Run) -> dict[str, Any]:
    """clients.lua's own line (FERRY_CLIENTS), taken out of the output kept."""
    lines = run.wrk_output.splitlines()
    line = next((x for x in lines if x.startswith("FERRY_CLIENTS ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no FERRY_CLIENTS line: {run.wrk_output[-2000:]}")
    run.wrk_output = "\n".join(x for x in lines if x != line)
    parsed: dict[str, Any] = json.loads(line.removeprefix("FERRY_CLIENTS "))
    times = sorted(float(v) for v in parsed["job_ms"])
    run.job_ms = {
        "count": len(times),
        "p50": _quantile(times, 0.50),
        "p99": _quantile(times, 0.99),
        "mean": round(statistics.fmean(times), 3) if times else None,
    }
    return parsed


def _worker_os_threads(up_pid: int) -> int | None:
    """OS threads of the minilm worker process (PyTorch's intra-op pool among them)."""
    table = processes()
    workers = [pid for pid, role in stack_roles(table, up_pid).items() if role == "worker"]
    with contextlib.suppress(OSError):
        return sum(len(os.listdir(f"/proc/{pid}/task")) for pid in workers)
    return None


def make_round(
    round_: int,
    offset: int,
    run: Run,
    clients: dict[str, Any],
    spent: Spent,
    ceiling: float,
) -> Round:
    jobs = run.jobs
    sizes = {str(k): int(v) for k, v in sorted(clients["batch_sizes"].items(), key=_size_key)}
    known = {int(k): v for k, v in sizes.items() if k.isdigit() and int(k) > 0}
    seen = sum(known.values())
    per_batch = seen / sum(v / k for k, v in known.items()) if known else None
    per_job = sum(k * v for k, v in known.items()) / seen if seen else None
    cpu = {role: run.cpu_ms_per_job.get(role, float("nan")) for role in CPU_ROLES}
    cpu["stack"] = round(sum(run.cpu_ms_per_job.get(role, 0.0) for role in STACK_ROLES), 3)
    # The stack's processes (its "other" ones too: none unless Flower runs) and wrk; the
    # machine's PostgreSQL serves others (this bench's stacks use SQLite).
    measured = sum(v for k, v in run.cpu_ms.items() if k not in ("postgres", "postgres_all"))
    other = max(0.0, spent.busy_ms - measured - spent.own_ms)
    cores = len(os.sched_getaffinity(0))
    job_ms = run.job_ms or {}
    return Round(
        round=round_,
        body_offset=offset,
        seconds=run.seconds,
        jobs=jobs,
        jobs_per_s=run.jobs_per_s,
        ratio=round(run.jobs_per_s / ceiling, 4) if ceiling else float("nan"),
        submitted=int(clients["submitted"]),
        job_p50_ms=job_ms.get("p50"),
        job_p99_ms=job_ms.get("p99"),
        job_mean_ms=job_ms.get("mean"),
        mean_batch_size=round(per_batch, 2) if per_batch else None,
        mean_batch_size_per_job=round(per_job, 2) if per_job else None,
        batch_sizes=sizes,
        states={str(k): int(v) for k, v in sorted(clients["states"].items())},
        cpu_ms_per_job=cpu,
        other_cpu_ms=round(other, 1),
        other_cpu_share=round(other / (spent.wall_s * 1000.0 * cores), 4),
        load_average_at_end=load_average(),
        run=run,
    )


def _size_key(item: tuple[str, Any]) -> tuple[int, str]:
    key = item[0]
    return (int(key), key) if key.isdigit() else (1 << 30, key)


def summarise(rounds: list[Round]) -> StackSummary:
    def values(name: str) -> Spread:
        return Spread(**spread([float(v) for r in rounds if (v := getattr(r, name)) is not None]))

    return StackSummary(
        jobs_per_s=values("jobs_per_s"),
        ratio=values("ratio"),
        job_p50_ms=values("job_p50_ms"),
        job_p99_ms=values("job_p99_ms"),
        mean_batch_size=values("mean_batch_size"),
        mean_batch_size_per_job=values("mean_batch_size_per_job"),
        cpu_ms_per_job={
            role: Spread(**spread([r.cpu_ms_per_job[role] for r in rounds]))
            for role in (*CPU_ROLES, "stack")
        },
        other_cpu_share=values("other_cpu_share"),
        non_2xx=sum(r.run.non_2xx for r in rounds),
        socket_errors=sum(sum(r.run.socket_errors.values()) for r in rounds),
        jobs=sum(r.jobs for r in rounds),
    )


# --- The report ---------------------------------------------------------------------------


def _quantile(ordered: list[float], q: float) -> float | None:
    return round(nearest_rank(ordered, q), 1) if ordered else None


def _line(r: Round) -> str:
    flags = ""
    if r.run.non_2xx or any(r.run.socket_errors.values()):
        bad = {k: v for k, v in r.run.statuses.items() if not k.startswith("2")}
        flags = f"  !! non-2xx {bad} socket errors {r.run.socket_errors}"
    p50 = f"{r.job_p50_ms:.0f}" if r.job_p50_ms is not None else "-"
    p99 = f"{r.job_p99_ms:.0f}" if r.job_p99_ms is not None else "-"
    batch = f"{r.mean_batch_size:.1f}" if r.mean_batch_size is not None else "-"
    return (
        f"{r.jobs_per_s:6.1f} jobs/s ({100 * r.ratio:5.1f} % of raw)  job p50 {p50} ms "
        f"p99 {p99} ms  batch {batch}  api {r.cpu_ms_per_job['api']:.1f} ms/job  "
        f"others {100 * r.other_cpu_share:.0f} % of the cores{flags}"
    )


def _range(figure: Spread, digits: int = 1, scale: float = 1.0) -> str:
    if math.isnan(figure.median):
        return "-"
    return (
        f"{scale * figure.median:.{digits}f} "
        f"({scale * figure.min:.{digits}f}-{scale * figure.max:.{digits}f})"
    )


def print_tables(raw: Raw, results: list[StackResult], options: Options) -> None:
    sizes = sorted({s for rates in raw.by_threads.values() for s in rates})
    print(
        f"\nraw model ceiling: minilm alone, {raw.texts} texts sorted by tokens "
        f"(mean {raw.tokens_mean} tokens), texts/s"
    )
    print(
        f"{'threads':>7} "
        + " ".join(f"{'batch ' + str(s):>10}" for s in sizes)
        + f" {'best':>8} {'others':>7}"
    )
    for count, rates in raw.by_threads.items():
        cells = " ".join(f"{rates[s]:>10.1f}" if s in rates else f"{'-':>10}" for s in sizes)
        others = max(raw.others_by_threads.get(count, {}).values(), default=0.0)
        print(f"{count:>7} {cells} {raw.best_by_threads[count]:>8.1f} {100 * others:>6.0f}%")
    again = (
        f"; timed again after the stacks: {raw.again:.1f} ({100 * (raw.drift or 0):+.1f} %, "
        f"others {100 * (raw.again_others or 0):.0f} %)"
        if raw.again is not None
        else ""
    )
    print(
        f"ceiling: {raw.ceiling:.1f} texts/s ({raw.ceiling_threads} thread(s), batch "
        f"{raw.ceiling_batch}){again}"
    )
    print(
        f"\nFerry: {options.clients} closed-loop clients (wrk -t1 -c{options.clients}), "
        f"{options.rounds} x {options.duration_s} s per stack; median (min-max) of the rounds; "
        "job ms: accepted -> finished; CPU ms per job"
    )
    print(
        f"{'FERRY_CPU_THREADS':>17} {'jobs/s':>18} {'% of ceiling':>18} {'job p50 ms':>16} "
        f"{'job p99 ms':>16} {'batch':>6} {'non2xx':>6} "
        + " ".join(f"{role:>6}" for role in ("api", "worker", "redis", "celery", "up", "wrk"))
        + f" {'stack':>6} {'others':>6}"
    )
    for result in results:
        if not result.summary:
            print(f"{result.cpu_threads:>17} failed: {(result.error or '').splitlines()[0]}")
            continue
        s = result.summary
        errors = s.non_2xx + s.socket_errors
        cpu = s.cpu_ms_per_job
        print(
            f"{result.cpu_threads:>17} {_range(s.jobs_per_s):>18} "
            f"{_range(s.ratio, 1, 100.0):>18} {_range(s.job_p50_ms, 0):>16} "
            f"{_range(s.job_p99_ms, 0):>16} {s.mean_batch_size.median:>6.1f} "
            f"{errors:>5}{'!' if errors else ' '} "
            + " ".join(f"{cpu[role].median:>6.2f}" for role in (*CPU_ROLES, "stack"))
            + f" {100 * s.other_cpu_share.median:>5.0f}%"
        )
    print(
        "(others: the machine's CPU time spent by processes other than the stack, wrk and "
        "this bench, as a share of all its cores; for the raw model, the most in any pass)"
    )


def best_threads(results: list[StackResult]) -> int | None:
    """The FERRY_CPU_THREADS whose median ratio is highest."""
    ranked = [(r.summary.ratio.median, r) for r in results if r.summary]
    ranked = [(ratio, r) for ratio, r in ranked if ratio > 0]
    if not ranked:
        return None
    return max(ranked, key=lambda found: found[0])[1].cpu_threads


def flags(results: list[StackResult], quiet: dict[str, Any] | None) -> list[str]:
    found = []
    if quiet is not None and not quiet["met"]:
        found.append(
            f"the load average was not below {quiet['below']} at two polls in a row within "
            f"{quiet['timeout_s']:.0f} s; the run went ahead"
        )
    for result in results:
        where = f"FERRY_CPU_THREADS={result.cpu_threads}"
        if result.error:
            found.append(f"{where}: failed: {result.error.splitlines()[0]}")
        for r in result.rounds:
            bad = {k: v for k, v in r.run.statuses.items() if not k.startswith("2")}
            errors = {k: v for k, v in r.run.socket_errors.items() if v}
            if bad or errors:
                found.append(
                    f"{where}, round {r.round}: non-2xx {bad or 0}, socket errors {errors or 0}"
                )
            failed = {k: v for k, v in r.states.items() if k != "succeeded"}
            if failed:
                found.append(f"{where}, round {r.round}: terminal but not succeeded: {failed}")
            if "none" in r.batch_sizes:
                found.append(
                    f"{where}, round {r.round}: {r.batch_sizes['none']} terminal jobs "
                    "without a batch (failed or expired before they ran?)"
                )
            if r.other_cpu_share > 0.1:
                found.append(
                    f"{where}, round {r.round}: other processes took "
                    f"{100 * r.other_cpu_share:.0f} % of the cores"
                )
    return found


def write_bodies(path: Path, texts: list[str]) -> None:
    """One JSON body a line (json.dumps escapes every newline and quote)."""
    with path.open("w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"model": MODEL, "input": text}) + "\n")


def _terminate(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C, so the stacks' finally blocks stop them.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=20, help="seconds of each round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warmup", type=int, default=10, help="seconds of clients first, per stack"
    )
    parser.add_argument("--clients", type=int, default=64, help="wrk's connections")
    parser.add_argument("--threads", default="1,2", help="FERRY_CPU_THREADS values (and raw's)")
    parser.add_argument("--texts", type=int, default=1000, help="the corpus sample's size")
    parser.add_argument("--raw-sizes", default="16,32,64", help="the raw model's batch sizes")
    parser.add_argument("--wait", type=int, default=30, help="seconds a long-poll waits at most")
    parser.add_argument(
        "--quiet-below", type=float, default=0.0, help="first wait for a 1-min load below this"
    )
    parser.add_argument("--quiet-timeout", type=float, default=2400.0)
    results.add_set_option(parser, "both stacks")
    parser.add_argument("--out", type=Path, default=Path("bench/results/clients.json"))
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not on the PATH (apt-get install -y wrk)", file=sys.stderr)
        return 2
    extra = dict(args.set)
    threads = [int(n) for n in args.threads.split(",")]
    sizes = [int(n) for n in args.raw_sizes.split(",")]
    options = Options(args.duration, args.rounds, args.warmup, args.clients, args.wait)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(args, argv, extra, threads, sizes, options)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(
    args: argparse.Namespace,
    argv: list[str] | None,
    extra: dict[str, str],
    threads: list[int],
    sizes: list[int],
    options: Options,
) -> int:
    from bench.corpus import load_corpus
    from core.config.settings import Settings

    quiet = wait_quiet(args.quiet_below, args.quiet_timeout) if args.quiet_below else None
    started = time.monotonic()
    head = provenance("clients", argv)
    settings = {
        "clients": options.clients,
        "wrk": f"wrk -t1 -c{options.clients} -d{options.duration_s}s --timeout 30s "
        "--latency -s bench/wrk/clients.lua",
        "rounds": options.rounds,
        "duration_s": options.duration_s,
        "warmup_s": options.warmup_s,
        "wait_s": options.wait_s,
        "threads": threads,
        "raw_batch_sizes": sizes,
        "ferry": {str(t): ferry_settings(t, extra) for t in threads},
        # Whether core.config.settings knows FERRY_CPU_THREADS (else the stacks ignore it).
        "cpu_threads_setting_known": "cpu_threads" in Settings.model_fields,
    }
    report: dict[str, Any] = {
        "quiet_wait": quiet,
        "load_average": {"at_start": load_average()},
    }
    tree_at_start = working_tree()
    corpus = load_corpus()
    texts, costs = corpus.texts[: args.texts], corpus.costs[: args.texts]
    report["sample"] = {
        "texts": len(texts),
        "corpus_texts": len(corpus.texts),
        "tokens_mean": round(statistics.fmean(costs), 1),
        "tokens_p50": statistics.median(costs),
        "tokens_max": max(costs),
    }
    print(
        f"{len(texts)} texts of the corpus, mean {report['sample']['tokens_mean']} tokens",
        flush=True,
    )
    model = RawModel(max(threads))
    raw = measure_raw(model, texts, costs, threads, sizes)
    print(
        f"ceiling {raw.ceiling:.1f} texts/s ({raw.ceiling_threads} thread(s), batch "
        f"{raw.ceiling_batch})",
        flush=True,
    )
    stacks: list[StackResult] = []
    with tempfile.TemporaryDirectory(prefix="ferry-bench-clients-bodies-") as tmp:
        bodies = Path(tmp) / "bodies.jsonl"
        write_bodies(bodies, texts)
        for count in threads:
            stacks.append(run_stack(count, options, bodies, len(texts), raw.ceiling, extra))
    raw_again(model, raw, texts, costs)
    report["load_average"]["at_end"] = load_average()
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["raw"] = asdict(raw)
    report["stacks"] = [asdict(r) for r in stacks]
    best = best_threads(stacks)
    report["best_cpu_threads"] = best
    report["ratios"] = {str(r.cpu_threads): asdict(r.summary.ratio) for r in stacks if r.summary}
    report["flags"] = flags(stacks, quiet)
    if working_tree() != tree_at_start:
        # Others edited the code meanwhile: the stacks may not have run the same code.
        head["git"]["working_tree_changed_during_run"] = True
        trees = ", ".join(f"threads {r.cpu_threads}: {r.working_tree}" for r in stacks)
        report["flags"].append(f"the working tree changed during the run (at each start: {trees})")
    print_tables(raw, stacks, options)
    chosen = next((r.summary for r in stacks if r.cpu_threads == best and r.summary), None)
    if chosen is not None:
        print(
            f"best for Ferry: FERRY_CPU_THREADS={best}, "
            f"{100 * chosen.ratio.median:.1f} % of the ceiling "
            "(median of the rounds)"
        )
    print(
        f"load average at start {report['load_average']['at_start']}, "
        f"at end {report['load_average']['at_end']}"
    )
    for flag in report["flags"]:
        print(f"FLAG: {flag}")
    results.write(args.out, report, settings=settings, head=head)
    print(f"wrote {args.out} ({report['elapsed_s']:.0f} s)")
    return 1 if any(r.error for r in stacks) else 0


# --- its tables (python -m bench.render) --------------------------------------------------


def render_clients_raw(results: Results) -> list[str]:
    doc, report = results["clients"], results.typed("clients", Report)
    raw = report.raw
    sizes = list(next(iter(raw.by_threads.values())))
    rows = []
    for threads, rates in raw.by_threads.items():
        row = [str(threads)]
        for size in sizes:
            best = threads == raw.ceiling_threads and size == raw.ceiling_batch
            row.append(f"**{rates[size]:.1f}** (the ceiling)" if best else f"{rates[size]:.1f}")
        rows.append(row)
    lines = [
        f"{measured_on(doc)}, load average "
        f"{report.load_average['at_start'][0]:.1f} at the start, "
        f"{report.sample['texts']:,} paragraphs of the corpus (mean "
        f"{report.sample['tokens_mean']} tokens). Raw model, texts/s:",
        "",
        *table(["torch threads", *(f"batch {s}" for s in sizes)], "l" + "r" * len(sizes), rows),
    ]
    if raw.again is not None and raw.drift is not None:
        lines += [
            "",
            f"(Timed again after the stacks, the ceiling's configuration gave {raw.again:.1f}"
            f", {abs(raw.drift):.1%} {'less' if raw.drift < 0 else 'more'}: the machine "
            "drifts by that much within a run.)".replace("%", " %", 1),
        ]
    return lines


def render_clients(results: Results) -> list[str]:
    report = results.typed("clients", Report)
    rows = []
    for stack in report.stacks:
        if stack.error or stack.summary is None:
            continue
        s = stack.summary
        best = stack.cpu_threads == report.best_cpu_threads

        def ms(value: float) -> str:
            # A round whose clients saw no job finish (a short smoke round on a busy
            # machine) has no latency; its file holds null, read as NaN.
            return "–" if math.isnan(value) else f"{value / 1000:.2f} s"

        rows.append(
            [
                str(stack.cpu_threads),
                Figure.summary(s.jobs_per_s).text(decimal(1), best),
                Figure.summary(s.ratio).text(percent(1), best),
                f"{ms(s.job_p50_ms.median)} / {ms(s.job_p99_ms.median)}",
                f"{s.mean_batch_size.median:.1f}",
                f"{s.cpu_ms_per_job['api'].median:.2f} ms",
                f"{s.cpu_ms_per_job['worker'].median:.1f} ms",
            ]
        )
    header = ["`FERRY_CPU_THREADS`", "jobs/s", "% of the ceiling", "job p50 / p99", "batch"]
    return table([*header, "API CPU / job", "worker CPU / job"], "lrrrrrr", rows)


def render_clients_target(results: Results) -> list[str]:
    report = results.typed("clients", Report)
    best = report.best_cpu_threads
    if best is None:
        return ["Against the target (80 % of the raw ceiling): no stack was measured."]
    figure = Figure.summary(report.ratios[best])
    return [
        f"Against the target (80 % of the raw ceiling, `FERRY_CPU_THREADS={best}`): "
        f"{figure.text(percent(1))}, {verdict(figure.meets(0.8, at_least=True))}."
    ]


if __name__ == "__main__":
    raise SystemExit(main())
