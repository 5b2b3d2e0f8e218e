"""A soak: steady load for an hour while workers, API processes and Redis are killed on a schedule.

The stack is the fault suite's (``harness.faults.Stack``), not ``ferry up``:
each process is a ``python -m ferry ...`` of its own, restarted when it exits
as ``ferry up`` and the Compose file restart them, around a redis-server the
soak can kill -9 and start again on its data, and a fresh PostgreSQL
database. ``ferry up`` owns its Redis and takes its children down with it, so
it cannot lose Redis and carry on; nor does it keep the records the counts
come from. The processes:

* ``api-1`` and ``api-2``: ``ferry api --reuse-port``, two API processes on
  one port (as ``FERRY_API_PROCESSES=2`` runs them); ``api-1`` is the one killed.
* ``worker-1`` and ``worker-2``: sim workers; ``worker-1`` is the one killed
  (restarted under its own name, it takes back the entries it held).
* ``celery-worker`` (the reconciler, webhooks), ``celery-beat`` and
  ``flower``, at their defaults (``FERRY_FLOWER_MAX_TASKS`` included: the
  bound on Flower's memory is what its line in the plot shows).
* ``redis``: AOF, fsync every second; killed with SIGKILL and started again
  on its data ``--redis-down`` seconds later. What it never got while down,
  the stream entries of jobs the API accepted meanwhile, the reconciler
  enqueues once they are older than its grace: that path is under test too.

Jobs go in at ``--rate`` a second, open loop, across the lanes (5 % urgent,
15 % vip, 70 % normal, 10 % bulk, random costs), each retried with its own
Idempotency-Key until answered (a request cut off by a kill cannot tell
whether its job was made). Kills of each kind come at a steady interval
(``--kill-worker-every``, ``--kill-api-every``, ``--kill-redis-every``; 0:
never), staggered so that no two land within seconds of each other.

The counts come from witnesses the code under test does not keep
(``harness.witness``, ``harness.accounting``), as the fault suite's do:

* **lost**: accepted (a 202) and never made terminal, by the transition log a
  trigger keeps in the database;
* **written twice**: made terminal more than once, by the same log;
* **run twice**: computed more than once by the sim model's own record of its
  computations (a nonce per output), where no killed worker explains it; a
  job computed again after a kill is counted apart (after crash), and only
  where it was among the last batches of a worker that died.

The done channel's announcements (pub/sub, which may drop messages) and the
workers' own execution record are kept beside them as cross-checks only.

Every ``--sample-every`` seconds the resident memory of each process (with
whatever it forked) is sampled; the samples go into the results file, and
a plot of them, with the kills, beside it (``soak.svg``).

    python -m bench.soak [--minutes 60] [--rate 30] [--kill-worker-every 240]
        [--kill-api-every 480] [--kill-redis-every 720] [--sample-every 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import secrets
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import results, svgplot
from bench.report import Results, counted, measured_on, table
from core.db import migrate
from core.db.schema import make_engine
from harness import webclient
from harness.accounting import Figures
from harness.faults import MODEL, Stack, tagged
from harness.ports import free_port
from harness.processes import process_table
from harness.services import postgres_database
from harness.submitting import Submission, Submitter
from harness.witness import install_transition_witness

LANES = (("urgent", 0.05), ("vip", 0.15), ("normal", 0.7), ("bulk", 0.1))
KINDS = ("worker", "api", "redis")
# The process of each kind that is killed; the other of its kind lives the whole run.
VICTIM = {"worker": "worker-1", "api": "api-1"}
SETTINGS = {
    "FERRY_SIM_LATENCY_BASE_MS": "20",
    "FERRY_SIM_LATENCY_PER_COST_MS": "0.2",
    # A killed worker's entries are taken over within seconds, not the default two minutes.
    "FERRY_VISIBILITY_TIMEOUT_S": "10",
    # What Redis never got while down is enqueued again within seconds.
    "FERRY_RECONCILE_INTERVAL_S": "5",
    "FERRY_RECONCILE_GRACE_S": "10",
}
# No two kills closer than this: each fault's recovery is its own.
KILL_GAP_S = 30.0
# Memory is compared from the first sample this long into the run (imports, caches, pools).
WARMUP_S = 60.0
# The plot keeps at most this many points a line (every n-th sample, and the last).
PLOT_POINTS = 180
PLOT_GROUPS = (
    ("API processes and sim workers", ("api-", "worker-")),
    ("Celery and Flower", ("celery-", "flower")),
    ("Redis", ("redis",)),
)
DRAIN_S = 300.0  # after the load: the longest wait for the last jobs to end


# --- what the run counts (pure) ---------------------------------------------------------------


def kill_schedule(
    seconds: float, every: Mapping[str, float], gap: float = KILL_GAP_S
) -> list[tuple[float, str]]:
    """When to kill what within ``seconds``: each kind every ``every[kind]`` seconds (0: never),
    the first half an interval in; a kill within ``gap`` of the one before it waits for the gap."""
    wanted = sorted(
        (period / 2 + k * period, kind)
        for kind, period in every.items()
        if period > 0
        for k in range(math.ceil(seconds / period) + 1)
    )
    gap = min(gap, *(p / 2 for p in every.values() if p > 0)) if wanted else gap
    schedule: list[tuple[float, str]] = []
    for at, kind in wanted:
        if schedule:
            at = max(at, schedule[-1][0] + gap)
        if at < seconds:
            schedule.append((round(at, 3), kind))
    return schedule


def problems(figures: Figures) -> list[str]:
    """What the witnesses say went wrong (nothing, for a clean run)."""
    d = figures.details
    found = [
        f"{figures.lost} lost" if figures.lost else "",
        f"{figures.written_twice} written twice" if figures.written_twice else "",
        f"{figures.run_twice} run twice" if figures.run_twice else "",
        f"{len(d['rejected'])} submissions never accepted" if d.get("rejected") else "",
        f"{d['orphan_rows']} rows no 202 answered for" if d.get("orphan_rows") else "",
        "results with no computation behind them" if d.get("succeeded_unexecuted") else "",
        "terminal rows the transition log missed" if d.get("terminal_untracked") else "",
        f"{d['bad_attempts']} jobs with impossible attempts" if d.get("bad_attempts") else "",
    ]
    return [p for p in found if p]


def lives(samples: Sequence[Mapping[str, Any]], name: str) -> list[list[Mapping[str, Any]]]:
    """``name``'s samples, split where its process changed (a restart): one list a life."""
    found: list[list[Mapping[str, Any]]] = []
    pid = None
    for sample in samples:
        if name not in sample["rss_mib"]:
            continue
        if sample["pid"][name] != pid:
            pid = sample["pid"][name]
            found.append([])
        found[-1].append(sample)
    return found


def settled_after(samples: Sequence[Mapping[str, Any]]) -> float:
    """Seconds into the run (and into a restarted process's life) memory is compared from:
    WARMUP_S, or a tenth of a run shorter than ten of them."""
    return round(min(WARMUP_S, samples[-1]["t_s"] / 10)) if samples else WARMUP_S


def memory_summary(
    samples: Sequence[Mapping[str, Any]], warmup_s: float
) -> dict[str, dict[str, Any]]:
    """Per process: its RSS at the first sample ``warmup_s`` in and at the last, its peak, how
    many lives it had, and its longest life's length and RSS (``warmup_s`` into it, at its end).

    See :func:`settled_after` for ``warmup_s``."""
    if not samples:
        return {}
    names = sorted({name for sample in samples for name in sample["rss_mib"]})
    summary = {}
    for name in names:
        seen = [s for s in samples if name in s["rss_mib"]]
        start = next((s for s in seen if s["t_s"] >= warmup_s), seen[-1])
        split = lives(samples, name)
        longest = max(split, key=lambda life: life[-1]["t_s"] - life[0]["t_s"])
        born = longest[0]["t_s"]
        settled = next((s for s in longest if s["t_s"] >= born + warmup_s), longest[-1])
        summary[name] = {
            "start_mib": start["rss_mib"][name],
            "end_mib": seen[-1]["rss_mib"][name],
            "peak_mib": max(s["rss_mib"][name] for s in seen),
            "lives": len(split),
            "longest_life_min": round((longest[-1]["t_s"] - born) / 60, 1),
            "longest_life_start_mib": settled["rss_mib"][name],
            "longest_life_end_mib": longest[-1]["rss_mib"][name],
        }
    return summary


def plot_series(doc: Mapping[str, Any]) -> list[tuple[str, str, list[svgplot.Series]]]:
    """The plot's charts, each a title, a y label and its lines: memory (MiB) against minutes,
    the processes grouped as PLOT_GROUPS, then the kills of each kind so far."""
    samples = doc["memory"]["samples"]
    step = max(1, math.ceil(len(samples) / PLOT_POINTS))
    kept = [*samples[::step], *([samples[-1]] if (len(samples) - 1) % step else [])]
    names = sorted({name for sample in samples for name in sample["rss_mib"]})
    grouped: dict[str, list[str]] = {title: [] for title, _ in PLOT_GROUPS}
    for name in names:
        title = next((t for t, prefixes in PLOT_GROUPS if name.startswith(prefixes)), "")
        grouped[title or PLOT_GROUPS[0][0]].append(name)
    charts = []
    for title, members in grouped.items():
        lines = [
            svgplot.Series(
                name,
                [(s["t_s"] / 60, s["rss_mib"].get(name, math.nan)) for s in kept],
            )
            for name in members
        ]
        charts.append((f"{title}: resident memory", "MiB", lines))
    end_min = samples[-1]["t_s"] / 60 if samples else 0.0
    kills = []
    for kind in KINDS:
        points = [(0.0, 0.0)]
        for count, at in enumerate(doc["kills"].get(kind, []), start=1):
            points += [(at / 60, count - 1.0), (at / 60, float(count))]
        points.append((end_min, float(len(doc["kills"].get(kind, [])))))
        kills.append(svgplot.Series(kind, points))
    charts.append(("Kills so far (SIGKILL)", "kills", kills))
    return charts


def write_plot(doc: Mapping[str, Any], path: Path) -> None:
    boxes = [svgplot.Box(80, 40, 440, 260), svgplot.Box(640, 40, 440, 260),
             svgplot.Box(80, 390, 440, 260), svgplot.Box(640, 390, 440, 260)]  # fmt: skip
    elements: list[str] = []
    for box, (title, y_label, lines) in zip(boxes, plot_series(doc), strict=True):
        elements += svgplot.line_chart(
            box, lines, title=title, x_label="minutes into the run", y_label=y_label
        )
    path.write_text(svgplot.document(1120, 700, elements), encoding="utf-8")


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Details:
    """The witnesses' account of the run (harness.accounting), and what the soak measured."""

    statuses: dict[str, int]
    missing_rows: int
    attempts: dict[int, int]  # jobs by their attempts
    bad_attempts: int
    executions_per_job: dict[int, int]
    succeeded_unexecuted: list[str]  # up to 20 ids each
    terminal_untracked: list[str]
    untagged_computations: int
    after_crash_ids: list[str]
    run_twice_ids: list[str]
    written_twice_ids: list[str]
    lost_ids: list[str]
    rejected: list[Any]
    retried: dict[str, int]  # by the error a client retried on
    submit_s: float
    replayed_after_retry: int
    # The cross-checks, where their sources were there.
    announced_twice: int = 0
    unannounced_terminal: int = 0
    record_executions: int = 0
    record_after_crash: int = 0
    record_run_twice: int = 0
    # The soak's own.
    stream_entries_left: int = 0
    orphan_rows: int = 0
    restarts: dict[str, list[int]] = field(default_factory=dict)
    reenqueued: int = 0
    reclaims: dict[str, int] = field(default_factory=dict)
    flower_events: int | None = 0  # None: Flower did not answer


@dataclass
class ProcessMemory:
    start_mib: float
    end_mib: float
    peak_mib: float
    lives: int
    longest_life_min: float
    longest_life_start_mib: float
    longest_life_end_mib: float


@dataclass
class Memory:
    settled_after_s: float
    summary: dict[str, ProcessMemory]  # by process
    samples: list[dict[str, Any]]  # each: t_s, and per process its RSS and pid


@dataclass
class Report:
    """bench/results/soak.json besides its head (bench.report.typed reads it)."""

    submitted: int
    completed: int
    lost: int
    executions: int
    after_crash: int
    run_twice: int
    written_twice: int
    seconds: float
    problems: list[str]
    kills: dict[str, list[float]]  # seconds into the run, by kind
    victims: dict[str, str]
    exits: dict[str, list[int]]
    details: Details
    memory: Memory


RESULT = Report


class Client(Submitter):
    """The careful client, with a new connection a request: each is spread over the API
    processes (SO_REUSEPORT hashes connections, not requests) as a load balancer would."""

    keepalive = False


class Soak:
    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.stack = stack
        self.args = args
        self.submission = Submission()
        self.kills: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.samples: list[dict[str, Any]] = []
        self.started = 0.0
        self.flower_port = free_port()
        self.flower_password = secrets.token_hex(12)

    def start(self) -> None:
        spawn = self.stack.spawn
        apis = [spawn(name, ["api", "--reuse-port"], True) for name in ("api-1", "api-2")]
        workers = [self.stack.start_worker(n, True, False) for n in ("worker-1", "worker-2")]
        spawn("celery-worker", ["celery", "worker"], True)
        spawn("celery-beat", ["celery", "beat"], True)
        spawn("flower", ["flower"], True, FERRY_FLOWER_PORT=str(self.flower_port),
              FERRY_FLOWER_PASSWORD=self.flower_password)  # fmt: skip
        for api in apis:
            self.stack.wait_api(api)
        for worker in workers:
            self.stack.wait_worker(worker)

    def submit(self, until: float) -> None:
        """Jobs at the rate, open loop, until ``until``; returns once every one is answered."""
        rng = random.Random(7)
        client = Client(self.stack.base, self.stack.token, threading.Event())
        pool = ThreadPoolExecutor(16)
        index = 0
        while (due := self.started + index / self.args.rate) < until:
            time.sleep(max(0.0, due - time.monotonic()))
            lane = rng.choices([name for name, _ in LANES], [w for _, w in LANES])[0]
            body = {"model": MODEL, "input": {"cost": rng.randint(1, 64)}, "priority": lane}
            pool.submit(client.submit_one, tagged([body])[0], self.submission, index, 120.0)
            index += 1
        pool.shutdown(wait=True)
        self.submission.seconds = time.monotonic() - self.started

    def kill(self, kind: str) -> None:
        at = round(time.monotonic() - self.started, 1)
        if kind == "redis":
            self.stack.kill_redis(wipe=False)
            time.sleep(self.args.redis_down)
            self.stack.start_redis()  # same port, same data directory
        else:
            proc = self.stack.procs[VICTIM[kind]]
            if not proc.alive():
                return  # between its death and its restart: nothing to kill
            assert proc.popen is not None
            os.kill(proc.popen.pid, signal.SIGKILL)  # supervised: started again at once
        self.kills[kind].append(at)
        print(json.dumps({"t_s": at, "killed": kind}), flush=True)

    def sample(self) -> None:
        """Each process's resident memory, with what it forked (its session: each has its own)."""
        sessions = {p.popen.pid: p.name for p in self.stack.procs.values() if p.alive() and p.popen}
        if self.stack.redis_process is not None:
            sessions[self.stack.redis_process.pid] = "redis"
        rss: dict[str, float] = {}
        for pid, _, session in process_table():
            if session in sessions:
                name = sessions[session]
                rss[name] = rss.get(name, 0.0) + _rss_mib(pid)
        self.samples.append(
            {
                "t_s": round(time.monotonic() - self.started, 1),
                "rss_mib": {name: round(mib, 1) for name, mib in sorted(rss.items())},
                "pid": {sessions[pid]: pid for pid in sessions if sessions[pid] in rss},
            }
        )

    def run(self) -> Figures:
        self.started = time.monotonic()
        seconds = self.args.minutes * 60
        until = self.started + seconds
        submitter = threading.Thread(target=self.submit, args=(until,), daemon=True)
        submitter.start()
        every = {"worker": self.args.kill_worker_every, "api": self.args.kill_api_every,
                 "redis": self.args.kill_redis_every}  # fmt: skip
        kills = kill_schedule(seconds, every)
        next_sample = self.started
        while submitter.is_alive():
            now = time.monotonic()
            if now >= next_sample:
                self.sample()
                print(json.dumps({k: v for k, v in self.samples[-1].items() if k != "pid"}),
                      flush=True)  # fmt: skip
                next_sample += self.args.sample_every
            if kills and now >= self.started + kills[0][0]:
                self.kill(kills.pop(0)[1])
            time.sleep(0.1)
        accounting = self.stack.account("soak", self.submission, self.started, DRAIN_S,
                                        lambda _: None)  # fmt: skip
        self.sample()
        details = accounting.figures.details
        details["reenqueued"] = self.stack.reenqueued(self.stack.procs["celery-worker"])
        details["reclaims"] = {
            name: self.stack.count_logs(
                self.stack.procs[name], "reclaimed entries another worker left unacknowledged"
            )
            for name in ("worker-1", "worker-2")
        }
        details["flower_events"] = self.flower_events()
        return accounting.figures

    def flower_events(self) -> int | None:
        """The Celery events Flower took in (each batch of a worker sends some): it was fed."""
        try:
            text = webclient.get(
                f"http://127.0.0.1:{self.flower_port}/metrics",
                auth=("ferry", self.flower_password),
                timeout=10,
            ).text
        except httpx.HTTPError:
            return None
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("flower_events_total{")
        )


@contextlib.contextmanager
def soak_stack(root: Path) -> Iterator[Stack]:
    """The stack on a fresh PostgreSQL database with the transition witness installed."""
    with postgres_database() as url:
        migrate.upgrade(url)
        engine = make_engine(url)
        try:
            install_transition_witness(engine)
        finally:
            engine.dispose()
        stack = Stack(root, url, SETTINGS)
        try:
            yield stack
        finally:
            stack.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=30.0, help="jobs per second")
    parser.add_argument("--kill-worker-every", type=float, default=240.0, help="s; 0: never")
    parser.add_argument("--kill-api-every", type=float, default=480.0, help="s; 0: never")
    parser.add_argument("--kill-redis-every", type=float, default=720.0, help="s; 0: never")
    parser.add_argument("--redis-down", type=float, default=1.0, help="s between kill and start")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args(argv)
    head = results.provenance("soak", argv)

    with tempfile.TemporaryDirectory(prefix="ferry-soak-") as tmp, soak_stack(Path(tmp)) as stack:
        soak = Soak(stack, args)
        soak.start()
        figures = soak.run()
        exits = {p.name: p.exits for p in stack.procs.values() if p.exits}
    settings = {
        "minutes": args.minutes,
        "rate_per_s": args.rate,
        "kill_every_s": {"worker": args.kill_worker_every, "api": args.kill_api_every,
                         "redis": args.kill_redis_every},
        "redis_down_s": args.redis_down,
        "sample_every_s": args.sample_every,
        "database": "postgresql",
        "stack": {name: value for name, value in SETTINGS.items()},
    }  # fmt: skip
    found = problems(figures)
    report = {
        **{k: v for k, v in asdict(figures).items() if k not in ("scenario", "details")},
        "problems": found,
        "kills": soak.kills,
        "victims": VICTIM,
        "exits": exits,
        "details": figures.details,
        "memory": {
            "settled_after_s": settled_after(soak.samples),
            "summary": memory_summary(soak.samples, settled_after(soak.samples)),
            "samples": soak.samples,
        },
    }
    results.write(args.out, report, settings=settings, head=head)
    plot = args.out.with_suffix(".svg")
    write_plot(report, plot)
    print(json.dumps({k: v for k, v in report.items() if k not in ("memory", "details")}))
    for name, m in report["memory"]["summary"].items():
        print(f"  {name:<14} RSS {m['start_mib']:7.1f} -> {m['end_mib']:7.1f} MiB, "
              f"peak {m['peak_mib']:7.1f}, {m['lives']} lives")  # fmt: skip
    print(f"wrote {args.out} and {plot}" + (f"; PROBLEMS: {', '.join(found)}" if found else ""))
    return 1 if found else 0


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


# --- its tables (python -m bench.render) --------------------------------------------------


SOAK_ORDER = ("api-", "worker-", "celery-", "flower", "redis")


def soak_names(summary: Mapping[str, Any]) -> list[str]:
    """The soak's processes in SOAK_ORDER, each kind's by name."""
    rank = {name: next((i for i, p in enumerate(SOAK_ORDER) if name.startswith(p)), 99)
            for name in summary}  # fmt: skip
    return sorted(summary, key=lambda name: (rank[name], name))


def render_soak(results: Results) -> list[str]:
    doc, report = results["soak"], results.typed("soak", Report)
    settings = doc["settings"]
    details = report.details
    kills, every, victims = report.kills, settings["kill_every_s"], report.victims

    def killed(kind: str, what: str) -> str:
        return f"{what} {counted(len(kills[kind]), 'time', 'times')} (every {every[kind]:g} s)"

    statuses = ", ".join(f"{n:,} {s}" for s, n in details.statuses.items())
    retried = sum(details.retried.values())
    rows = []
    for name in soak_names(report.memory.summary):
        m = report.memory.summary[name]
        label = f"{name} (killed)" if name in victims.values() or name == "redis" else name
        longest = (
            f"{m.longest_life_min:g} min: {m.longest_life_start_mib:.1f} → "
            f"{m.longest_life_end_mib:.1f}"
            if m.lives > 1
            else "the whole run"
        )
        rows.append([label, str(m.lives), f"{m.start_mib:.1f} → {m.end_mib:.1f}",
                     f"{m.peak_mib:.1f}", longest])  # fmt: skip
    problems = f" Problems: {', '.join(report.problems)}." if report.problems else ""
    return [
        f"{measured_on(doc)}: {settings['minutes']:g} minutes "
        f"at {settings['rate_per_s']:g} jobs/s across the lanes, PostgreSQL, with SIGKILL for "
        f"{killed('worker', 'a sim worker')}, {killed('api', 'an API process')} and "
        f"{killed('redis', 'Redis')}, started again on its data "
        f"{settings['redis_down_s']:g} s later. **{report.submitted:,} jobs accepted, "
        f"{report.completed:,} made terminal ({statuses}): {report.lost:,} lost, "
        f"{report.written_twice:,} written twice, {report.run_twice:,} run twice**, by the "
        f"database's transition log and the sim's record of its computations; "
        f"{report.after_crash:,} computed again after a kill, each in the last batches of a "
        f"killed worker. The clients retried {retried:,} requests (same Idempotency-Key), "
        f"{details.replayed_after_retry:,} answered with the job a cut-off request had made; "
        f"the reconciler enqueued {details.reenqueued:,} jobs again. The done channel, a "
        f"cross-check only, announced {details.announced_twice:,} jobs twice and missed "
        f"{details.unannounced_terminal:,}.{problems}",
        "",
        "Resident memory in MiB, each process with what it forked: from the first sample "
        f"{report.memory.settled_after_s:g} s in to the last, the peak, and a restarted "
        f"process's longest life (from {report.memory.settled_after_s:g} s into it):",
        "",
        *table(["process", "lives", "RSS MiB", "peak", "longest life"], "lrrrl", rows),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
