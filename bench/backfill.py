# ruff: noqa: RUF001
"""Backfills beside live traffic: what a backfill that saturates the model costs interactive jobs.

Each run (``--repeats``, three by default) on a fresh stack (``ferry up`` with
only the sim model: its own Redis, SQLite, API, worker, Celery worker and
beat). The sim model sleeps
``base + per_cost x sum(cost)`` per batch, so it does not compete for the CPU
and its raw throughput is known from the formula. In order:

* **idle**: an open-loop stream of interactive jobs (Poisson arrivals, 5 % urgent,
  15 % vip, 80 % normal, cost 1-8) through ``POST /v1/jobs`` with nothing
  else running. Latency is the server's own: ``timings.total_ms`` of the job
  resource (``finished_at - created_at``), read after the window with
  ``GET /v1/jobs/{id}?wait=``; P50/P99 per lane and overall.
* **backfill alone**: a backfill far larger than the run can finish
  (``POST /v1/backfills?model=sim``, NDJSON, cost 1-8) is uploaded; once the
  feeder has it flowing, its ``request_counts.completed`` is sampled over a
  window with no interactive traffic: lines per second, against the raw
  throughput of the model at full batches (``max batch size / batch latency``
  from the formula with the backfill's mean cost).
* **busy**: the same interactive stream (the same arrivals, lanes and costs)
  while the backfill keeps running; the same P50/P99, the backfill's lines
  per second over the window, and the mean batch latency (``avg_batch_ms``
  from ``GET /v1/models``, sampled through the window). The backfill must
  still be ``in_progress`` when the window ends (else the model was not
  saturated throughout, and the report says so).

The target: interactive P99 with the backfill running no worse than idle P99
plus one batch latency (``target_met = p99_busy_ms <= p99_idle_ms + one_batch_ms``), where
``one_batch_ms`` is the mean batch latency measured through the busy window; the report also
judges it against a full batch of the formula (``target_met_full_batch``).
At the end the backfill is cancelled, its results are read back
(``GET /v1/backfills/{id}/results``: one line per settled item), and the stack
stops, also on error. Everything talks to 127.0.0.1 only; every wait is bounded.

    python -m bench.backfill [--rate 20] [--window 20] [--alone 15] [--lines 30000] [--repeats 3]
                             [--set FERRY_NAME=VALUE ...] [--out bench/results/backfill.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import results
from bench.quantiles import nearest_rank
from bench.report import Figure, Fmt, Results, Spread, decimal, measured_on, percent, table, verdict
from harness import webclient
from harness.stack import FerryUp

# The lane mix of bench/simulate.py (5 % urgent, 15 % vip, 80 % normal).
LANES = (("urgent", 0.05), ("vip", 0.15), ("normal", 0.8))
TERMINAL = ("succeeded", "failed", "expired", "cancelled")
COST_RANGE = (1, 8)
# The stack under test: sim only, one batch of 32 at cost 4.5 is ~92 ms.
STACK = {
    "FERRY_MODELS": "sim",
    "FERRY_SIM_LATENCY_BASE_MS": "20",
    "FERRY_SIM_LATENCY_PER_COST_MS": "0.5",
    "FERRY_BATCH_MAX_SIZE": "32",
}


@dataclass
class Arrival:
    at_s: float  # offset from the start of the window
    lane: str
    cost: int


@dataclass
class Sent:
    arrival: Arrival
    lag_ms: float  # sent this late against its schedule (the load generator's own delay)
    post_ms: float  # the POST's round trip, as the client saw it
    status: int
    job_id: str | None


@dataclass
class Latency:
    jobs: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_batch_size: float  # of the batches these jobs ran in
    mean_inference_ms: float  # those batches' latency


@dataclass
class Stream:
    offered: int
    accepted: int
    refused: dict[str, int]
    seconds: float
    rate_per_s: float
    send_lag_p99_ms: float
    post_p50_ms: float
    post_p99_ms: float
    statuses: dict[str, int]
    overall: Latency
    lanes: dict[str, Latency]


@dataclass
class BackfillWindow:
    seconds: float
    completed: int  # lines completed within the window
    lines_per_s: float
    status_at_end: str
    left_at_end: int  # lines not yet settled when the window ended
    avg_batch_ms: float  # mean of /v1/models samples through the window
    avg_batch_size: float
    bulk_depth_max: int  # the bulk lane's unacknowledged entries, most seen (the feeder's bound)
    samples: int


@dataclass
class Run:
    """One run, on a fresh stack."""

    settings: dict[str, str]
    rate_per_s: float
    window_s: float
    alone_s: float
    lines: int
    backfill_mean_cost: float
    upload_s: float = 0.0
    idle: Stream | None = None
    backfill_alone: BackfillWindow | None = None
    busy: Stream | None = None
    backfill_busy: BackfillWindow | None = None
    full_batch_ms: float = 0.0  # the formula: base + per_cost x 32 x mean cost
    raw_lines_per_s: float = 0.0  # the model alone at full batches
    alone_share_of_raw: float = 0.0
    busy_share_of_raw: float = 0.0
    p99_idle_ms: float = 0.0
    p99_busy_ms: float = 0.0
    one_batch_ms: float = 0.0  # measured: the mean batch latency through the busy window
    target_ms: float = 0.0
    target_met: bool = False
    # The same with a full batch of the formula as "one batch" (the batch an
    # interactive job may find running when the guard is off).
    target_full_batch_ms: float = 0.0
    target_met_full_batch: bool = False
    saturated: bool = False  # the backfill was still in progress when the busy window ended
    backfill_end: dict[str, Any] = field(default_factory=dict)
    load_average: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0


@dataclass
class Summary:
    p99_idle_ms: Spread
    p99_busy_ms: Spread
    alone_share_of_raw: Spread
    busy_share_of_raw: Spread
    target_met_full_batch: bool  # in every run
    target_met: bool


@dataclass
class Report:
    """bench/results/backfill.json besides its head (bench.report.typed reads it)."""

    runs: list[Run]
    summary: Summary


RESULT = Report


class Bench:
    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.args = args
        self.settings = {**STACK, **dict(args.set)}
        # Celery's beat and worker feed the backfill to the queue.
        self.stack = FerryUp(root, celery=True, **self.settings)
        self.client: httpx.Client | None = None

    def start(self) -> None:
        self.stack.start()
        if not self.stack.base.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"refusing to talk to {self.stack.base}")
        self.client = webclient.client(
            base_url=self.stack.base,
            headers={"Authorization": f"Bearer {self.stack.token}"},
            timeout=30,
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
        )

    @property
    def http(self) -> httpx.Client:
        assert self.client is not None
        return self.client

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.stack.stop(self.stack.process)

    # --- interactive traffic ----------------------------------------------------

    def stream(self, arrivals: list[Arrival]) -> list[Sent]:
        """Submit on schedule (open loop: a slow answer never delays the next send)."""
        sent: list[Sent] = []
        lock = threading.Lock()

        def post(arrival: Arrival, lag_ms: float) -> None:
            body = {"model": "sim", "input": {"cost": arrival.cost}, "priority": arrival.lane}
            began = time.monotonic()
            try:
                response = self.http.post("/v1/jobs", json=body)
                status = response.status_code
                job_id = response.json()["id"] if status == 202 else None
            except httpx.HTTPError:
                status, job_id = 0, None
            post_ms = (time.monotonic() - began) * 1000.0
            with lock:
                sent.append(Sent(arrival, lag_ms, post_ms, status, job_id))

        futures: list[Future[None]] = []
        with ThreadPoolExecutor(16) as pool:
            started = time.monotonic()
            for arrival in arrivals:
                delay = started + arrival.at_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                lag_ms = (time.monotonic() - started - arrival.at_s) * 1000.0
                futures.append(pool.submit(post, arrival, lag_ms))
            for future in futures:
                future.result()
        return sent

    def collect(self, sent: list[Sent], timeout_s: float) -> dict[str, dict[str, Any]]:
        """Every accepted job's resource once terminal (long-polled), within ``timeout_s``."""
        until = time.monotonic() + timeout_s

        def fetch(job_id: str) -> dict[str, Any]:
            while True:
                left = until - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"job {job_id} not finished within {timeout_s:.0f} s")
                wait = max(1, min(10, int(left)))
                job: dict[str, Any] = self.http.get(
                    f"/v1/jobs/{job_id}", params={"wait": wait}
                ).json()
                if job["status"] in TERMINAL:
                    return job

        ids = [s.job_id for s in sent if s.job_id]
        with ThreadPoolExecutor(8) as pool:
            return dict(zip(ids, pool.map(fetch, ids), strict=True))

    def run_stream(self, name: str, arrivals: list[Arrival], during: Callable[[], None]) -> Stream:
        print(f"{name}: {len(arrivals)} interactive jobs over {self.args.window:.0f} s", flush=True)
        started = time.monotonic()
        sent = self.stream(arrivals)
        seconds = time.monotonic() - started
        during()
        jobs = self.collect(sent, timeout_s=60)
        return summarize(sent, jobs, seconds)

    # --- the backfill -----------------------------------------------------------

    def upload(self, lines: int, rng: random.Random) -> tuple[str, float, float]:
        """A backfill of ``lines`` lines; returns its id, the upload seconds and the mean cost."""
        costs = [rng.randint(*COST_RANGE) for _ in range(lines)]
        body = "".join(
            json.dumps({"custom_id": f"line-{i}", "input": {"cost": cost}}) + "\n"
            for i, cost in enumerate(costs)
        ).encode()
        started = time.monotonic()
        response = self.http.post(
            "/v1/backfills",
            params={"model": "sim"},
            content=body,
            headers={"Content-Type": "application/x-ndjson"},
            timeout=120,
        )
        if response.status_code != 202:
            raise RuntimeError(f"backfill refused: {response.status_code} {response.text[:500]}")
        backfill = response.json()
        if backfill["request_counts"]["total"] != lines:
            raise RuntimeError(f"backfill holds {backfill['request_counts']} of {lines} lines")
        return backfill["id"], time.monotonic() - started, statistics.fmean(costs)

    def backfill(self, backfill_id: str) -> dict[str, Any]:
        found: dict[str, Any] = self.http.get(f"/v1/backfills/{backfill_id}").json()
        return found

    def sim_stats(self) -> dict[str, Any]:
        models = self.http.get("/v1/models").json()["data"]
        found: dict[str, Any] = next(m for m in models if m["name"] == "sim")
        return found

    def wait_flowing(self, backfill_id: str, at_least: int, timeout_s: float) -> None:
        until = time.monotonic() + timeout_s
        while True:
            state = self.backfill(backfill_id)
            if state["status"] != "in_progress":
                raise RuntimeError(f"backfill is {state['status']} before the windows")
            if state["request_counts"]["completed"] >= at_least:
                return
            if time.monotonic() > until:
                raise RuntimeError(f"backfill not flowing after {timeout_s:.0f} s: {state}")
            time.sleep(0.5)


class Sampler:
    """Samples the backfill's progress and the model's batch stats until stopped."""

    def __init__(self, bench: Bench, backfill_id: str, every_s: float = 1.0) -> None:
        self.bench = bench
        self.backfill_id = backfill_id
        self.every_s = every_s
        self.samples: list[tuple[float, dict[str, Any], dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[float, dict[str, Any], dict[str, Any]]:
        now = time.monotonic()
        found = (now, self.bench.backfill(self.backfill_id), self.bench.sim_stats())
        self.samples.append(found)
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def start(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """The last sample, at the window's end (only the first call takes it)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()

    def window(self) -> BackfillWindow:
        (t0, first, _), (t1, last, _) = self.samples[0], self.samples[-1]
        done = last["request_counts"]["completed"] - first["request_counts"]["completed"]
        counts = last["request_counts"]
        settled = sum(v for k, v in counts.items() if k != "total")
        stats = [s for _, _, s in self.samples if s.get("avg_batch_ms") is not None]
        return BackfillWindow(
            seconds=round(t1 - t0, 2),
            completed=done,
            lines_per_s=round(done / (t1 - t0), 1),
            status_at_end=last["status"],
            left_at_end=counts["total"] - settled,
            avg_batch_ms=round(statistics.fmean(s["avg_batch_ms"] for s in stats), 1),
            avg_batch_size=round(statistics.fmean(s["avg_batch_size"] for s in stats), 1),
            bulk_depth_max=max(s["queue_depth"]["bulk"] for _, _, s in self.samples),
            samples=len(self.samples),
        )


def poisson(rate: float, seconds: float, rng: random.Random) -> list[Arrival]:
    arrivals: list[Arrival] = []
    at = rng.expovariate(rate)
    names, weights = [n for n, _ in LANES], [w for _, w in LANES]
    while at < seconds:
        lane = rng.choices(names, weights)[0]
        arrivals.append(Arrival(round(at, 6), lane, rng.randint(*COST_RANGE)))
        at += rng.expovariate(rate)
    return arrivals


def summarize(sent: list[Sent], jobs: dict[str, dict[str, Any]], seconds: float) -> Stream:
    refused: dict[str, int] = {}
    for s in sent:
        if s.job_id is None:
            refused[str(s.status)] = refused.get(str(s.status), 0) + 1
    statuses: dict[str, int] = {}
    for job in jobs.values():
        statuses[job["status"]] = statuses.get(job["status"], 0) + 1
    by_lane: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in LANES}
    for s in sent:
        if s.job_id is not None:
            by_lane[s.arrival.lane].append(jobs[s.job_id])
    lags = sorted(s.lag_ms for s in sent)
    posts = sorted(s.post_ms for s in sent)
    return Stream(
        offered=len(sent),
        accepted=len(jobs),
        refused=refused,
        seconds=round(seconds, 2),
        rate_per_s=round(len(sent) / seconds, 1),
        send_lag_p99_ms=round(nearest_rank(lags, 0.99), 1),
        post_p50_ms=round(nearest_rank(posts, 0.50), 1),
        post_p99_ms=round(nearest_rank(posts, 0.99), 1),
        statuses=statuses,
        overall=latency(list(jobs.values())),
        lanes={name: latency(found) for name, found in by_lane.items()},
    )


def latency(jobs: list[dict[str, Any]]) -> Latency:
    done = [j for j in jobs if j["status"] == "succeeded"]
    totals = sorted(float(j["timings"]["total_ms"]) for j in done)
    sizes = [j["batch"]["size"] for j in done if j.get("batch")]
    inference = [j["timings"]["inference_ms"] for j in done if j["timings"]["inference_ms"]]
    return Latency(
        jobs=len(done),
        p50_ms=round(nearest_rank(totals, 0.50), 1),
        p99_ms=round(nearest_rank(totals, 0.99), 1),
        max_ms=round(totals[-1], 1) if totals else float("nan"),
        mean_batch_size=round(statistics.fmean(sizes), 1) if sizes else float("nan"),
        mean_inference_ms=round(statistics.fmean(inference), 1) if inference else float("nan"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0, help="interactive jobs per second")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of interactive load")
    parser.add_argument("--alone", type=float, default=15.0, help="seconds of backfill alone")
    parser.add_argument("--lines", type=int, default=30_000, help="backfill lines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs, each on a fresh stack")
    results.add_set_option(parser, "the stack")
    parser.add_argument("--out", type=Path, default=Path("bench/results/backfill.json"))
    args = parser.parse_args(argv)
    if not (0 < args.rate <= 200 and 0 < args.window <= 120 and 0 < args.alone <= 120):
        parser.error("--rate at most 200/s, --window and --alone at most 120 s")
    if not 1000 <= args.lines <= 200_000:
        parser.error("--lines between 1000 and 200000")

    head = results.provenance("backfill", argv)
    runs = results.repeated(args.repeats, lambda: run(args), print_summary)
    settings = {
        "rate_per_s": args.rate,
        "window_s": args.window,
        "alone_s": args.alone,
        "lines": args.lines,
        "seed": args.seed,
        "repeats": args.repeats,
        "stack": runs[0].settings,
    }
    spreads = {
        name: Spread(**results.spread([getattr(r, name) for r in runs]))
        for name in ("p99_idle_ms", "p99_busy_ms", "alone_share_of_raw", "busy_share_of_raw")
    }
    summary = Summary(
        **spreads,
        target_met_full_batch=all(r.target_met_full_batch for r in runs),
        target_met=all(r.target_met for r in runs),
    )
    report = Report(runs, summary)
    results.write(args.out, asdict(report), settings=settings, head=head)
    print(f"wrote {args.out}")
    return 0


def run(args: argparse.Namespace) -> Run:
    began = time.monotonic()
    rng = random.Random(args.seed)
    arrivals = poisson(args.rate, args.window, rng)
    with tempfile.TemporaryDirectory(prefix="ferry-bench-backfill-") as tmp:
        bench = Bench(Path(tmp), args)
        report = Run(
            settings=bench.settings,
            rate_per_s=args.rate,
            window_s=args.window,
            alone_s=args.alone,
            lines=args.lines,
            backfill_mean_cost=0.0,
        )
        report.load_average["start"] = _loadavg()
        try:
            bench.start()
            print(f"stack up at {bench.stack.base}", flush=True)
            warm = poisson(args.rate, 2.0, random.Random(args.seed + 1))
            bench.collect(bench.stream(warm), timeout_s=30)

            report.idle = bench.run_stream("idle", arrivals, lambda: None)

            backfill_id, upload_s, mean_cost = bench.upload(args.lines, rng)
            report.upload_s = round(upload_s, 2)
            report.backfill_mean_cost = round(mean_cost, 3)
            print(f"backfill {backfill_id}: {args.lines} lines in {upload_s:.1f} s")
            # Flowing, and most of it still to run through the windows that follow.
            bench.wait_flowing(backfill_id, at_least=min(1000, args.lines // 4), timeout_s=60)
            time.sleep(2.0)  # the feeder's lane at its working depth

            print(f"backfill alone: {args.alone:.0f} s", flush=True)
            alone = Sampler(bench, backfill_id).start()
            try:
                time.sleep(args.alone)
            finally:
                alone.stop()
            report.backfill_alone = alone.window()

            busy = Sampler(bench, backfill_id).start()
            try:
                report.busy = bench.run_stream("busy", arrivals, busy.stop)
            finally:
                busy.stop()
            report.backfill_busy = busy.window()
            report.saturated = (
                report.backfill_busy.status_at_end == "in_progress"
                and report.backfill_busy.left_at_end > 0
            )
            report.backfill_end = finish_backfill(bench, backfill_id, timeout_s=60)
        finally:
            bench.close()
    report.load_average["end"] = _loadavg()
    judge(report)
    report.wall_s = round(time.monotonic() - began, 1)
    return report


def finish_backfill(bench: Bench, backfill_id: str, timeout_s: float) -> dict[str, Any]:
    """Cancel the backfill, wait until it settles, and read its results back."""
    response = bench.http.post(f"/v1/backfills/{backfill_id}/cancel")
    until = time.monotonic() + timeout_s
    state = bench.backfill(backfill_id)
    while state["status"] not in ("completed", "failed", "cancelled"):
        if time.monotonic() > until:
            break
        time.sleep(0.5)
        state = bench.backfill(backfill_id)
    lines = 0
    statuses: dict[str, int] = {}
    with bench.http.stream("GET", f"/v1/backfills/{backfill_id}/results", timeout=60) as results:
        for line in results.iter_lines():
            if line.strip():
                lines += 1
                status = json.loads(line)["status"]
                statuses[status] = statuses.get(status, 0) + 1
    counts = state["request_counts"]
    return {
        "cancel_status_code": response.status_code,
        "status": state["status"],
        "request_counts": counts,
        "result_lines": lines,
        "result_statuses": statuses,
        "results_match_counts": lines == sum(v for k, v in counts.items() if k != "total"),
    }


def judge(report: Run) -> None:
    assert report.idle and report.busy and report.backfill_alone and report.backfill_busy
    size = int(report.settings["FERRY_BATCH_MAX_SIZE"])
    base = float(report.settings["FERRY_SIM_LATENCY_BASE_MS"])
    per_cost = float(report.settings["FERRY_SIM_LATENCY_PER_COST_MS"])
    report.full_batch_ms = round(base + per_cost * size * report.backfill_mean_cost, 1)
    report.raw_lines_per_s = round(size / (report.full_batch_ms / 1000.0), 1)
    report.alone_share_of_raw = round(report.backfill_alone.lines_per_s / report.raw_lines_per_s, 3)
    report.busy_share_of_raw = round(report.backfill_busy.lines_per_s / report.raw_lines_per_s, 3)
    report.p99_idle_ms = report.idle.overall.p99_ms
    report.p99_busy_ms = report.busy.overall.p99_ms
    report.one_batch_ms = report.backfill_busy.avg_batch_ms
    report.target_ms = round(report.p99_idle_ms + report.one_batch_ms, 1)
    report.target_met = report.p99_busy_ms <= report.target_ms
    report.target_full_batch_ms = round(report.p99_idle_ms + report.full_batch_ms, 1)
    report.target_met_full_batch = report.p99_busy_ms <= report.target_full_batch_ms


def print_summary(report: Run) -> None:
    assert report.idle and report.busy and report.backfill_alone and report.backfill_busy
    print(f"\n{'lane':<8} {'idle p50':>9} {'idle p99':>9} {'busy p50':>9} {'busy p99':>9} (ms)")
    for lane in [name for name, _ in LANES] + ["overall"]:
        idle = report.idle.overall if lane == "overall" else report.idle.lanes[lane]
        busy = report.busy.overall if lane == "overall" else report.busy.lanes[lane]
        print(
            f"{lane:<8} {idle.p50_ms:>9.1f} {idle.p99_ms:>9.1f} {busy.p50_ms:>9.1f} "
            f"{busy.p99_ms:>9.1f}"
        )
    alone, busy_bf = report.backfill_alone, report.backfill_busy
    print(
        f"\nraw model at full batches: {report.raw_lines_per_s:.0f} lines/s "
        f"({report.full_batch_ms:.0f} ms per batch of {report.settings['FERRY_BATCH_MAX_SIZE']})"
    )
    print(
        f"backfill alone: {alone.lines_per_s:.0f} lines/s "
        f"({report.alone_share_of_raw:.0%} of raw), "
        f"batches {alone.avg_batch_size:.1f} x {alone.avg_batch_ms:.0f} ms"
    )
    print(
        f"backfill beside interactive: {busy_bf.lines_per_s:.0f} lines/s "
        f"({report.busy_share_of_raw:.0%} of raw), batches {busy_bf.avg_batch_size:.1f} x "
        f"{busy_bf.avg_batch_ms:.0f} ms; {busy_bf.status_at_end} at the window's end, "
        f"{busy_bf.left_at_end} lines left"
    )
    print(
        f"bulk lane depth at most {max(alone.bulk_depth_max, busy_bf.bulk_depth_max)} "
        f"(FERRY_BACKFILL_OUTSTANDING bounds it)"
    )
    verdict = "met" if report.target_met else "NOT met"
    print(
        f"target p99_busy <= p99_idle + one batch: {report.p99_busy_ms:.1f} <= "
        f"{report.p99_idle_ms:.1f} + {report.one_batch_ms:.1f} = {report.target_ms:.1f} ms: "
        f"{verdict}"
    )
    print(
        f"  (a full batch of the formula as one batch: <= {report.target_full_batch_ms:.1f} ms: "
        f"{'met' if report.target_met_full_batch else 'NOT met'})"
    )
    if not report.saturated:
        print("warning: the backfill did not keep the model busy through the whole window")
    print(f"backfill end: {report.backfill_end}")
    print(f"wall time {report.wall_s:.0f} s; load average {report.load_average}")


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# --- its tables (python -m bench.render) --------------------------------------------------


def stream_of(run: Run, phase: str) -> Stream:
    """The run's idle or busy window (a run always has both once it is written)."""
    stream = run.idle if phase == "idle" else run.busy
    if stream is None:
        raise ValueError(f"a backfill run without its {phase} window")
    return stream


def render_backfill_latency(results: Results) -> list[str]:
    doc, runs = results["backfill"], results.typed("backfill", Report).runs
    first = runs[0]
    over = f"; median of {len(runs)} runs (min–max)" if len(runs) > 1 else ""
    wall = Figure.of(r.wall_s for r in runs).text(decimal())
    ride = first.settings.get("FERRY_BULK_RIDE_FACTOR", "1.25")
    idle_lanes = first.idle.lanes if first.idle else {}
    lines = [
        f"{measured_on(doc)}, load average "
        f"{first.load_average['start'][0]:.1f} at the start, {wall} s of wall time a run, "
        f"`FERRY_BULK_RIDE_FACTOR={ride}`"
        + (" (the default)" if "FERRY_BULK_RIDE_FACTOR" not in first.settings else "")
        + f"{over}. A full batch of the backfill's mean cost "
        f"({first.backfill_mean_cost:.2f}) takes {first.full_batch_ms:.1f} ms: the raw "
        f"model does {first.raw_lines_per_s:.1f} lines/s at full batches. Interactive "
        f"latency, ms (urgent has {idle_lanes['urgent'].jobs} jobs and vip "
        f"{idle_lanes['vip'].jobs}, so their p99 is their maximum):",
        "",
    ]
    rows = []
    for lane in ("urgent", "vip", "normal", "all"):

        def at(phase: str, key: str, bold: bool = False, lane: str = lane) -> str:
            streams = [stream_of(r, phase) for r in runs]
            values = [getattr(s.overall if lane == "all" else s.lanes[lane], key) for s in streams]
            # A lane no job of a phase went to (a short run) has no latency to show.
            if any(math.isnan(value) for value in values):
                return "–"
            return Figure.of(values).text(decimal(1), bold)

        bold = lane == "all"
        rows.append(
            [
                "**all**" if bold else lane,
                at("idle", "p50_ms"),
                at("idle", "p99_ms", bold),
                at("busy", "p50_ms"),
                at("busy", "p99_ms", bold),
            ]
        )
    lines += table(["lane", "idle p50", "idle p99", "busy p50", "busy p99"], "lrrrr", rows)

    def overall(phase: str, key: str) -> str:
        return Figure.of(getattr(stream_of(r, phase).overall, key) for r in runs).text(decimal(1))

    lines += [
        "",
        f"Interactive jobs ran in batches of {overall('idle', 'mean_batch_size')} jobs "
        f"({overall('idle', 'mean_inference_ms')} ms) on average when idle, and "
        f"{overall('busy', 'mean_batch_size')} jobs ({overall('busy', 'mean_inference_ms')} ms)"
        " beside the backfill. The backfill:",
        "",
    ]
    return lines


def render_backfill_throughput(results: Results) -> list[str]:
    runs = results.typed("backfill", Report).runs
    first = runs[0]

    def of(window: str, key: str, fmt: Fmt) -> str:
        values = [getattr(r, window) for r in runs]
        return Figure.of(getattr(v, key) if key else v for v in values).text(fmt)

    size = first.settings["FERRY_BATCH_MAX_SIZE"]
    rows = [
        [
            "raw model, full batches (formula)",
            f"{first.raw_lines_per_s:.1f}",
            "100 %",
            f"{size} × {first.full_batch_ms:.1f} ms",
        ]
    ]
    for window, share, what in (
        ("backfill_alone", "alone_share_of_raw", "backfill alone"),
        ("backfill_busy", "busy_share_of_raw", f"backfill beside {first.rate_per_s:g} "
         "interactive jobs/s"),
    ):  # fmt: skip
        rows.append(
            [
                what,
                of(window, "lines_per_s", decimal(1)),
                of(share, "", percent()),
                f"{of(window, 'avg_batch_size', decimal(1))} × "
                f"{of(window, 'avg_batch_ms', decimal(1))} ms",
            ]
        )
    return table(["", "lines/s", "of raw", "batches"], "lrrl", rows)


def render_backfill_target(results: Results) -> list[str]:
    runs = results.typed("backfill", Report).runs

    def of(key: str) -> Figure:
        return Figure.of(getattr(r, key) for r in runs)

    full = of("target_full_batch_ms")
    mean = of("target_ms")
    full_met = all(r.target_met_full_batch for r in runs)
    mean_met = all(r.target_met for r in runs)
    rows = [
        ["`p99_idle_ms`", of("p99_idle_ms").text(decimal(1))],
        ["`p99_busy_ms`", of("p99_busy_ms").text(decimal(1), bold=True)],
        [
            f"idle p99 + a full bulk batch ({runs[0].full_batch_ms:.1f} ms): the batch an"
            " interactive job may find running",
            f"{full.text(decimal(1))}: **{'met' if full_met else 'not met'}**",
        ],
        [
            f"idle p99 + the mean batch of the busy window ({of('one_batch_ms').text(decimal(1))}"
            " ms)",
            f"{mean.text(decimal(1))}: {'met' if mean_met else 'not met'}",
        ],
    ]
    return table(["figure", "ms"], "lr", rows)


def headline_backfill(results: Results) -> str:
    runs = results.typed("backfill", Report).runs
    busy = Figure.of(r.p99_busy_ms for r in runs)
    alone = Figure.of(r.alone_share_of_raw for r in runs)
    met = all(r.target_met_full_batch for r in runs)
    return (
        "- **Backfills beside live traffic.** On the same stack with the sim model, beside a "
        f"backfill that saturates the model, {runs[0].rate_per_s:g} interactive jobs/s see "
        f"a p99 of {busy.text(decimal(0, ' ms'), True)} (target: idle p99 plus one full batch, "
        f"{verdict(met)}); the backfill alone runs at {alone.text(percent(), True)} of the "
        "raw model."
    )


if __name__ == "__main__":
    sys.exit(main())
