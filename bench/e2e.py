# ruff: noqa: RUF001
"""End to end, not simulated: the real stack, minilm, the corpus through HTTP.

For each batching policy (``none``, ``fixed``, ``ferry``) in one run on one
machine, this starts a fresh stack with ``ferry up`` (its own Redis, SQLite),
and measures two things:

* **drain**: every job is submitted through ``POST /v1/jobs`` while no minilm
  worker runs, so the queue holds the whole corpus; then one worker starts and
  drains it. Jobs per second = jobs / (last finished - first started). This is
  the serving throughput of the worker path (Redis, scheduler, model, result
  writes) under saturation, without the load generator competing for the CPU.
* **live**: with the worker running, the same number of jobs is submitted by
  concurrent HTTP clients as fast as the API takes them, and the clock runs
  from the first submission to the last result. Here the API, the clients and
  the worker share the machine, as they would on a single host.

Beside them, in the same run, the raw ceiling: the model alone in this
process, inputs sorted by length, at its best batch size.

    python -m bench.e2e [--jobs 1200] [--concurrency 16] [--rounds 3] [--out bench/results/e2e.json]

Each round measures the raw ceiling, then every policy; the ratios are taken
round by round, and the results give their median and range. ``--one-stack``
(the smoke run's) runs every policy on one stack, each with a worker of its own:
quicker, but a policy then starts from what the previous one left in Redis and
the database, so its figures are not comparable.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import results
from bench.corpus import load_corpus
from bench.quantiles import nearest_rank
from bench.report import (
    Figure,
    Results,
    decimal,
    machine_text,
    measured_on,
    percent,
    table,
    times,
    verdict,
)
from harness import webclient
from harness.stack import FerryUp
from scheduler.vocabulary import batch_work

MODES = ("none", "fixed", "ferry")
TERMINAL = ("succeeded", "failed", "expired", "cancelled")


@dataclass
class Phase:
    jobs: int
    seconds: float
    jobs_per_s: float
    p50_ms: float
    p99_ms: float
    batches: int
    mean_batch_size: float
    efficiency: float  # cost-weighted: sum cost / sum (n x max cost)
    failed: int


@dataclass
class ModeResult:
    mode: str
    submit_per_s: float
    drain: Phase
    live: Phase


@dataclass
class Round:
    """One repeat: the raw ceiling, then every policy, on the machine as it was then."""

    round: int
    raw_by_batch: dict[int, float] = field(default_factory=dict)
    raw_ceiling: float = 0.0
    modes: list[ModeResult] = field(default_factory=list)
    # Per policy, this round's drain and live rates against none's and against the ceiling.
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Report:
    jobs: int
    concurrency: int
    mean_cost: float
    rounds: list[Round] = field(default_factory=list)
    # Per policy and ratio: the median of the rounds and their range.
    summary: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)


# What bench/results/e2e.json holds besides its head (bench.report.typed reads it).
RESULT = Report


def raw_ceiling(texts: list[str], sizes: tuple[int, ...]) -> dict[int, float]:
    """Texts per second of the model alone, inputs sorted by length, per batch size."""
    from backends.catalog import load_runtime, repository_for
    from core.config.settings import Settings

    settings = Settings(device=os.environ.get("FERRY_DEVICE", "auto"))
    runtime = load_runtime(repository_for(settings)["minilm"], settings)
    ordered = sorted(texts, key=len)
    rates: dict[int, float] = {}
    for size in sizes:
        started = time.perf_counter()
        for i in range(0, len(ordered), size):
            runtime.run(ordered[i : i + size])
        rates[size] = len(ordered) / (time.perf_counter() - started)
        print(f"  raw model, batch {size:>3}: {rates[size]:7.1f} texts/s", flush=True)
    return rates


class Stack(FerryUp):
    """``ferry up`` with no workers, plus a minilm worker started on demand."""

    def __init__(self, mode: str, root: Path) -> None:
        super().__init__(
            root, celery=False, FERRY_MODELS="", FERRY_SCHEDULER=mode, FERRY_PREFETCH="256"
        )
        self.worker: subprocess.Popen[str] | None = None

    def start_worker(self, mode: str) -> None:
        # The policy is the worker's setting: a stack the policies share starts one per policy.
        self.env["FERRY_SCHEDULER"] = mode
        self.worker = self.spawn([sys.executable, "-m", "ferry", "worker", "--model", "minilm"])

    def stop_all(self) -> None:
        self.stop(self.worker, 60)
        self.stop(self.process, 60)

    @property
    def db(self) -> Path:
        return self.root / "ferry.db"


def submit_all(stack: Stack, texts: list[str], concurrency: int) -> tuple[list[str], float]:
    """POST every text as a minilm job; returns the ids and the seconds it took."""
    headers = {"Authorization": f"Bearer {stack.token}"}
    chunks = [texts[i::concurrency] for i in range(concurrency)]

    def run(chunk: list[str]) -> list[str]:
        ids = []
        with webclient.client(base_url=stack.base, headers=headers, timeout=60) as client:
            for text in chunk:
                response = client.post("/v1/jobs", json={"model": "minilm", "input": text})
                if response.status_code != 202:
                    raise RuntimeError(f"submit failed: {response.status_code} {response.text}")
                ids.append(response.json()["id"])
        return ids

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        ids = [job_id for chunk_ids in pool.map(run, chunks) for job_id in chunk_ids]
    return ids, time.perf_counter() - started


def wait_done(db: Path, ids: list[str], timeout_s: float) -> None:
    until = time.monotonic() + timeout_s
    marks = ",".join("?" * len(TERMINAL))
    while True:
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
            done = conn.execute(
                f"SELECT count(*) FROM jobs WHERE status IN ({marks}) AND id IN "
                f"(SELECT value FROM json_each(?))",
                (*TERMINAL, json.dumps(ids)),
            ).fetchone()[0]
        if done == len(ids):
            return
        if time.monotonic() > until:
            raise RuntimeError(f"only {done} of {len(ids)} jobs finished in {timeout_s:.0f} s")
        time.sleep(0.5)


def job_rows(db: Path, ids: list[str], columns: str) -> list[Any]:
    """``columns`` (SQL: names, or aggregates of them) of these jobs' rows in the SQLite
    database ``db``; the rows in no particular order."""
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        return conn.execute(
            f"SELECT {columns} FROM jobs WHERE id IN (SELECT value FROM json_each(?))",
            (json.dumps(ids),),
        ).fetchall()


def measure(db: Path, ids: list[str], clock_from: str) -> Phase:
    """Throughput and latency of these jobs, from the results table."""
    rows = job_rows(db, ids, "created_at, started_at, finished_at, status, cost, batch_id")
    created = [_ts(r[0]) for r in rows]
    started = [_ts(r[1]) for r in rows if r[1]]
    finished = [_ts(r[2]) for r in rows]
    begin = min(started) if clock_from == "started" else min(created)
    seconds = max(finished) - begin
    latencies = sorted((f - c) * 1000.0 for c, f in zip(created, finished, strict=True))
    batches: dict[str, list[int]] = {}
    for row in rows:
        if row[5]:
            batches.setdefault(row[5], []).append(int(row[4]))
    padded = sum(batch_work(c, padded=True) for c in batches.values())
    return Phase(
        jobs=len(rows),
        seconds=round(seconds, 3),
        jobs_per_s=round(len(rows) / seconds, 2),
        p50_ms=round(nearest_rank(latencies, 0.50), 1),
        p99_ms=round(nearest_rank(latencies, 0.99), 1),
        batches=len(batches),
        mean_batch_size=round(statistics.fmean(len(c) for c in batches.values()), 2),
        efficiency=round(sum(sum(c) for c in batches.values()) / padded, 3),
        failed=sum(1 for r in rows if r[3] != "succeeded"),
    )


@contextlib.contextmanager
def started_stack(mode: str) -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix=f"ferry-bench-{mode}-") as tmp:
        stack = Stack(mode, Path(tmp))
        try:
            stack.start()
            yield stack
        finally:
            stack.stop_all()


def run_modes(
    modes: list[str], texts: list[str], concurrency: int, timeout_s: float, one_stack: bool
) -> list[ModeResult]:
    """Every policy, each on a fresh stack (or, ``one_stack``, all on the first policy's)."""
    if not one_stack:
        found = []
        for mode in modes:
            with started_stack(mode) as stack:
                found.append(run_mode(stack, mode, texts, concurrency, timeout_s))
        return found
    with started_stack(modes[0]) as stack:
        return [run_mode(stack, mode, texts, concurrency, timeout_s) for mode in modes]


def run_mode(
    stack: Stack, mode: str, texts: list[str], concurrency: int, timeout_s: float
) -> ModeResult:
    """The drain, then the live phase, of one policy on ``stack`` (no worker running)."""
    ids, submit_s = submit_all(stack, texts, concurrency)
    print(f"  {mode}: {len(ids)} jobs queued ({len(ids) / submit_s:.0f}/s)", flush=True)
    stack.start_worker(mode)
    try:
        wait_done(stack.db, ids, timeout_s)
        drain = measure(stack.db, ids, "started")
        print(f"  {mode}: drain {drain.jobs_per_s:.1f} jobs/s", flush=True)
        live_ids, _ = submit_all(stack, texts, concurrency)
        wait_done(stack.db, live_ids, timeout_s)
        live = measure(stack.db, live_ids, "created")
        print(f"  {mode}: live  {live.jobs_per_s:.1f} jobs/s", flush=True)
    finally:
        stack.stop(stack.worker, 60)
    return ModeResult(mode, round(len(ids) / submit_s, 1), drain, live)


def ratios(round_: Round) -> dict[str, dict[str, float]]:
    none = next((m for m in round_.modes if m.mode == "none"), None)
    found = {}
    for m in round_.modes:
        found[m.mode] = {
            "drain_share_of_raw": round(m.drain.jobs_per_s / round_.raw_ceiling, 3),
            "live_share_of_raw": round(m.live.jobs_per_s / round_.raw_ceiling, 3),
        }
        if none is not None:
            found[m.mode]["drain_vs_none"] = round(m.drain.jobs_per_s / none.drain.jobs_per_s, 3)
            found[m.mode]["live_vs_none"] = round(m.live.jobs_per_s / none.live.jobs_per_s, 3)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3, help="repeats of the whole")
    parser.add_argument("--raw-sizes", default="1,8,16,32,64", help="the raw model's batch sizes")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--one-stack",
        action="store_true",
        help="every policy on one stack (quicker; the figures are not comparable)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/e2e.json"))
    args = parser.parse_args(argv)
    head = results.provenance("e2e", argv)

    corpus = load_corpus()
    texts = corpus.texts[: args.jobs]
    costs = corpus.costs[: args.jobs]
    report = Report(
        jobs=len(texts),
        concurrency=args.concurrency,
        mean_cost=round(statistics.fmean(costs), 1),
    )
    print(f"{len(texts)} texts, mean {report.mean_cost} tokens", flush=True)
    sizes = tuple(int(n) for n in args.raw_sizes.split(","))
    for number in range(1, args.rounds + 1):
        round_ = Round(number)
        round_.raw_by_batch = {k: round(v, 1) for k, v in raw_ceiling(texts, sizes).items()}
        round_.raw_ceiling = max(round_.raw_by_batch.values())
        modes = args.modes.split(",")
        round_.modes = run_modes(modes, texts, args.concurrency, args.timeout, args.one_stack)
        round_.ratios = ratios(round_)
        report.rounds.append(round_)
        print_table(round_)
    report.summary = {
        mode: {
            name: results.spread([r.ratios[mode][name] for r in report.rounds])
            for name in report.rounds[0].ratios[mode]
        }
        for mode in report.rounds[0].ratios
    }
    settings = {
        "jobs": args.jobs,
        "concurrency": args.concurrency,
        "modes": args.modes.split(","),
        "rounds": args.rounds,
        "one_stack": args.one_stack,
        "raw_batch_sizes": list(sizes),
        "device": os.environ.get("FERRY_DEVICE", "auto"),
        "ferry": {"FERRY_PREFETCH": "256"},
    }
    results.write(args.out, asdict(report), settings=settings, head=head)
    print(f"wrote {args.out}")
    return 0


def print_table(report: Round) -> None:
    none = next((m for m in report.modes if m.mode == "none"), None)
    print(f"\nround {report.round}: raw model ceiling {report.raw_ceiling:.1f} texts/s (sorted)")
    print(
        f"{'mode':<6} {'drain/s':>8} {'% raw':>6} {'x none':>7} {'live/s':>7} {'% raw':>6} "
        f"{'x none':>7} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6} {'eff':>5}"
    )
    for m in report.modes:
        cells = [f"{m.mode:<6}"]
        for phase, base in (
            (m.drain, none.drain if none else None),
            (m.live, none.live if none else None),
        ):
            ratio = phase.jobs_per_s / base.jobs_per_s if base else float("nan")
            share = 100 * phase.jobs_per_s / report.raw_ceiling
            cells.append(f"{phase.jobs_per_s:>8.1f} {share:>5.0f}% {ratio:>6.2f}x")
        cells.append(f"{m.live.p50_ms:>8.0f} {m.live.p99_ms:>8.0f}")
        cells.append(f"{m.drain.mean_batch_size:>6.1f} {m.drain.efficiency:>5.2f}")
        print(" ".join(cells))


def _ts(value: str) -> float:
    parsed = dt.datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


# --- its tables (python -m bench.render) --------------------------------------------------


def e2e_figures(report: Report) -> dict[str, dict[str, Figure]]:
    # A round's ratios, computed where an older file did not keep them.
    per_round = [r.ratios or ratios(r) for r in report.rounds]
    figures: dict[str, dict[str, Figure]] = {}
    for mode in per_round[0]:
        found = {k: Figure.of(r[mode][k] for r in per_round) for k in per_round[0][mode]}
        for phase in ("drain", "live"):
            found[f"{phase}_jobs_per_s"] = Figure.of(
                getattr(next(m for m in r.modes if m.mode == mode), phase).jobs_per_s
                for r in report.rounds
            )
        figures[mode] = found
    figures["raw"] = {
        "ceiling": Figure.of(r.raw_ceiling for r in report.rounds),
        "gain": Figure.of(r.raw_ceiling / r.raw_by_batch[1] for r in report.rounds),
    }
    return figures


def render_e2e(results: Results) -> list[str]:
    doc, report = results["e2e"], results.typed("e2e", Report)
    rounds = report.rounds
    first = rounds[0]
    raw = first.raw_by_batch
    best = max(raw, key=lambda k: raw[k])
    shown = [
        f"**{raw[k]:.0f} at {k}** (the ceiling)" if k == best else f"{raw[k]:.0f} at {k}"
        for k in raw
    ]
    shown[0] = shown[0].replace(" at ", " texts/s at batch ", 1)
    over = f"; median of {len(rounds)} rounds (min–max)" if len(rounds) > 1 else ""
    lines = [
        f"{measured_on(doc)}, {report.jobs:,} paragraphs, "
        f"mean {report.mean_cost} tokens{over}. Raw model"
        + (" (first round)" if len(rounds) > 1 else "")
        + ": "
        + ", ".join(shown)
        + ".",
        "",
    ]
    figures = e2e_figures(report)
    labels = {"fixed": "fixed (32, 5 ms)"}
    rows = []
    for m in first.modes:
        mode, f = m.mode, figures[m.mode]
        bold = mode == "ferry"
        rows.append(
            [
                labels.get(mode, mode),
                f["drain_jobs_per_s"].text(decimal(1), bold),
                f["drain_share_of_raw"].text(percent(), bold),
                f["drain_vs_none"].text(times(), bold),
                f["live_jobs_per_s"].text(decimal(1)),
                f["live_share_of_raw"].text(percent()),
                f["live_vs_none"].text(times()),
                f"{m.drain.mean_batch_size:.1f}",
                f"{m.drain.efficiency:.2f}",
            ]
        )
    header = ["policy", "drain jobs/s", "% of raw", "× none", "live jobs/s", "% of raw", "× none"]
    return lines + table([*header, "batch size", "efficiency"], "lrrrrrrrr", rows)


def render_e2e_targets(results: Results) -> list[str]:
    figures = e2e_figures(results.typed("e2e", Report))
    ferry, raw = figures["ferry"], figures["raw"]
    rows = [
        [
            "drain ≥ 85 % of the raw ceiling",
            ferry["drain_share_of_raw"].text(percent()),
            verdict(ferry["drain_share_of_raw"].meets(0.85, at_least=True)),
        ],
        [
            "drain ≥ 3 × batching off (`none`)",
            ferry["drain_vs_none"].text(times()),
            verdict(ferry["drain_vs_none"].meets(3.0, at_least=True)),
        ],
        ["the model's own gain from batching (ceiling / batch 1)", raw["gain"].text(times()), "—"],
    ]
    return table(["target (ferry)", "value", "met"], "lrl", rows)


def headline_e2e(results: Results) -> str:
    doc = results["e2e"]
    ferry = e2e_figures(results.typed("e2e", Report))["ferry"]
    share, gain = ferry["drain_share_of_raw"], ferry["drain_vs_none"]
    return (
        f"- **End to end** (HTTP, Redis, SQLite, all-MiniLM-L6-v2 on {machine_text(doc)}), a "
        f"Ferry worker drains a saturated queue at {share.text(percent(), True)} of the "
        f"model's raw ceiling (target 85 %: {verdict(share.meets(0.85, True))}) and "
        f"{gain.text(times())} batching off (target 3×: {verdict(gain.meets(3.0, True))})."
    )


if __name__ == "__main__":
    raise SystemExit(main())
