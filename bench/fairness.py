# ruff: noqa: RUF001
"""Tenant isolation, end to end: one tenant floods a lane, another keeps its latency.

On one fresh ``ferry up`` stack with a ``sim`` worker (a batch sleeps
``base + per_cost x its cost``; the figures below are set so that a full batch
of 32 takes about 1.5 x a batch of one, as MiniLM's do on a data-centre GPU,
and the sleeping leaves the CPU to the API), a *steady* tenant submits
normal-lane jobs at a fixed rate, open loop, in three phases of equal length:

* **alone**: nobody else;
* **flood, own key**: before the phase, with the worker stopped, a second
  tenant (its own API key) queues ``--flood`` jobs in the same lane of the same
  model; the worker starts with the phase and is still working through them
  when it ends;
* **flood, shared key**: the same flood, but the steady jobs are sent with
  the flooding key, so they queue first come first served behind it: what a
  single shared queue (one stream per lane, or any FIFO) does to them.

Latency is accepted -> finished, from the results table. Beside it, for each
steady job, the batches that *started* after it was accepted and before its
own. Ferry's promise is at most one: the batch the worker had just formed
when the job arrived (a batch already running then is not counted, and the
job runs in the next one).

    python -m bench.fairness [--seconds 20] [--rate 10] [--flood 8000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import results
from bench.e2e import _ts, job_rows, wait_done
from bench.quantiles import nearest_rank
from bench.report import (
    Figure,
    Results,
    Spread,
    batches,
    decimal,
    measured_on,
    table,
)
from harness import webclient
from harness.stack import FerryUp

MODEL = "sim"
COST = 25  # per job: a batch of one takes 61 ms, a full batch of 32 takes 92 ms
SIM = {"FERRY_SIM_LATENCY_BASE_MS": "60", "FERRY_SIM_LATENCY_PER_COST_MS": "0.04"}


@dataclass
class PhaseResult:
    name: str
    jobs: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    flood_jobs_finished: int
    batches_ahead_p99: int  # batches started between a steady job's arrival and its own
    batches_ahead_max: int
    batch_p50_ms: float | None  # batches finished during the phase, started -> finished
    batch_p99_ms: float | None


@dataclass
class Run:
    """One repeat of the three phases, on a fresh stack."""

    phases: list[PhaseResult]
    p99_rise_ms: float  # flood with its own key, over alone
    one_batch_ms: float  # the P99 batch during that flood
    within_one_batch: bool  # no steady job had more than one batch start ahead of its own
    shared_key_p99_ms: float


@dataclass
class Summary:
    p99_rise_ms: Spread
    batches_ahead_max: int  # with the flood on its own key, the most of any run
    within_one_batch: bool  # in every run


@dataclass
class Report:
    """bench/results/fairness.json besides its head (bench.report.typed reads it)."""

    runs: list[Run]
    summary: Summary


RESULT = Report


def submit_many(base: str, token: str, count: int, threads: int = 8, cost: int = COST) -> list[str]:
    """``count`` jobs as fast as the API takes them."""
    headers = {"Authorization": f"Bearer {token}"}

    def send(share: int) -> list[str]:
        ids = []
        with webclient.client(base_url=base, headers=headers, timeout=60) as client:
            for _ in range(share):
                response = client.post("/v1/jobs", json={"model": MODEL, "input": {"cost": cost}})
                if response.status_code != 202:
                    raise RuntimeError(f"flood refused: {response.status_code} {response.text}")
                ids.append(response.json()["id"])
        return ids

    shares = [count // threads + (1 if i < count % threads else 0) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        return [job for ids in pool.map(send, shares) for job in ids]


def steady(base: str, token: str, rate: float, seconds: float) -> list[str]:
    """Jobs at ``rate`` per second, evenly spaced, each sent on time (open loop)."""
    headers = {"Authorization": f"Bearer {token}"}
    count = int(rate * seconds)
    begin = time.monotonic()

    def send(number: int) -> str:
        time.sleep(max(0.0, begin + number / rate - time.monotonic()))
        with webclient.client(base_url=base, headers=headers, timeout=60) as client:
            response = client.post("/v1/jobs", json={"model": MODEL, "input": {"cost": COST}})
        if response.status_code != 202:
            raise RuntimeError(f"steady job refused: {response.status_code} {response.text}")
        return str(response.json()["id"])

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(send, range(count)))


def phase(
    name: str, db: Path, ids: list[str], window: tuple[float, float], flood: list[str]
) -> PhaseResult:
    rows = job_rows(db, ids, "created_at, finished_at, batch_id")
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        batches = conn.execute(
            "SELECT batch_id, min(started_at), max(finished_at) FROM jobs "
            "WHERE batch_id IS NOT NULL GROUP BY batch_id"
        ).fetchall()
    flood_finished = job_rows(db, flood, "finished_at")
    begin, end = window
    starts = {batch: _ts(start) for batch, start, _f in batches if start}
    ordered = sorted(starts.values())
    latencies = sorted((_ts(f) - _ts(c)) * 1000.0 for c, f, _b in rows)
    # Batches that started after the job was accepted and before its own did.
    ahead = sorted(
        bisect.bisect_left(ordered, starts[batch]) - bisect.bisect_right(ordered, _ts(created))
        for created, _f, batch in rows
        if batch in starts
    )
    spans = sorted(
        (_ts(f) - _ts(s)) * 1000.0 for _b, s, f in batches if s and f and begin <= _ts(f) < end
    )
    return PhaseResult(
        name=name,
        jobs=len(rows),
        p50_ms=round(nearest_rank(latencies, 0.50), 1),
        p99_ms=round(nearest_rank(latencies, 0.99), 1),
        max_ms=round(latencies[-1], 1),
        flood_jobs_finished=sum(1 for (f,) in flood_finished if f and begin <= _ts(f) < end),
        batches_ahead_p99=int(nearest_rank([float(n) for n in ahead], 0.99)),
        batches_ahead_max=ahead[-1],
        batch_p50_ms=round(nearest_rank(spans, 0.50), 1) if spans else None,
        batch_p99_ms=round(nearest_rank(spans, 0.99), 1) if spans else None,
    )


def create_key(stack: FerryUp, name: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "ferry", "keys", "create", "--name", name],
        cwd=stack.root,
        env=stack.env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip().splitlines()[-1]


def run(seconds: float, rate: float, flood_jobs: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="ferry-bench-fairness-") as tmp:
        # No worker from ferry up: the benchmark starts and stops its own.
        stack = FerryUp(
            Path(tmp),
            celery=False,
            FERRY_MODELS="",
            FERRY_RATE_LIMIT="100000/second",
            FERRY_MAX_OUTSTANDING_JOBS="100000",
            **SIM,
        )
        worker: subprocess.Popen[str] | None = None
        try:
            stack.start()
            db = stack.root / "ferry.db"
            flooder = create_key(stack, "flood")
            results = []
            for name, token, flooding in (
                ("alone", stack.token, False),
                ("flood, own key", stack.token, True),
                ("flood, shared key", flooder, True),
            ):
                flood = submit_many(stack.base, flooder, flood_jobs) if flooding else []
                worker = stack.spawn([sys.executable, "-m", "ferry", "worker", "--model", MODEL])
                _wait_ready(stack)
                begin = time.time()
                ids = steady(stack.base, token, rate, seconds)
                end = time.time()
                print(f"  {name}: {len(ids)} steady jobs sent, waiting for them", flush=True)
                wait_done(db, ids + flood, timeout_s=600)
                results.append(phase(name, db, ids, (begin, end), flood))
                print(f"  {name}: {asdict(results[-1])}", flush=True)
                stack.stop(worker, 60)
        finally:
            stack.stop(worker, 60)
            stack.stop(stack.process, 60)
    alone, own, shared = results
    return Run(
        phases=results,
        p99_rise_ms=round(own.p99_ms - alone.p99_ms, 1),
        one_batch_ms=own.batch_p99_ms or 0.0,
        within_one_batch=own.batches_ahead_max <= 1,
        shared_key_p99_ms=shared.p99_ms,
    )


def _wait_ready(stack: FerryUp, timeout_s: float = 120.0) -> None:
    """Until the worker has published its heartbeat (GET /v1/models lists it live)."""
    headers = {"Authorization": f"Bearer {stack.token}"}
    until = time.monotonic() + timeout_s
    with webclient.client(base_url=stack.base, headers=headers, timeout=30) as client:
        while time.monotonic() < until:
            models = client.get("/v1/models").json()["data"]
            if next(m for m in models if m["name"] == MODEL).get("workers"):
                return
            time.sleep(0.2)
    raise RuntimeError("the sim worker did not come up")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=10.0, help="steady jobs per second")
    parser.add_argument("--flood", type=int, default=8000, help="jobs the flooder queues")
    parser.add_argument("--repeats", type=int, default=3, help="runs, each on a fresh stack")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fairness.json"))
    args = parser.parse_args(argv)
    head = results.provenance("fairness", argv)
    runs = results.repeated(
        args.repeats, lambda: run(args.seconds, args.rate, args.flood), print_run
    )
    settings = {
        "seconds": args.seconds,
        "rate_per_s": args.rate,
        "flood_jobs": args.flood,
        "repeats": args.repeats,
        "sim": {"cost": COST, **SIM},
    }
    summary = Summary(
        p99_rise_ms=Spread(**results.spread([r.p99_rise_ms for r in runs])),
        batches_ahead_max=max(r.phases[1].batches_ahead_max for r in runs),
        within_one_batch=all(r.within_one_batch for r in runs),
    )
    report = Report(runs, summary)
    results.write(args.out, asdict(report), settings=settings, head=head)
    print(f"wrote {args.out}")
    return 0


def print_run(report: Run) -> None:
    print(
        f"{'phase':18} {'jobs':>5} {'P50 ms':>7} {'P99 ms':>7} {'max ms':>7} "
        f"{'ahead P99':>9} {'ahead max':>9} {'batch P99':>9}"
    )
    for p in report.phases:
        batch = f"{p.batch_p99_ms:.0f}" if p.batch_p99_ms is not None else "-"
        print(
            f"{p.name:18} {p.jobs:>5} {p.p50_ms:>7.0f} {p.p99_ms:>7.0f} {p.max_ms:>7.0f} "
            f"{p.batches_ahead_p99:>9} {p.batches_ahead_max:>9} {batch:>9}"
        )
    verdict = "at most one batch" if report.within_one_batch else "MORE than one batch"
    print(
        f"flood, own key: {verdict} ahead of any steady job; P99 +{report.p99_rise_ms:.0f} ms "
        f"(one batch: {report.one_batch_ms:.0f} ms); behind a shared queue: "
        f"P99 {report.shared_key_p99_ms:.0f} ms"
    )


# --- its tables (python -m bench.render) --------------------------------------------------


def render_fairness(results: Results) -> list[str]:
    doc, report = results["fairness"], results.typed("fairness", Report)
    runs = report.runs
    over = f"; median of {len(runs)} runs (min–max)" if len(runs) > 1 else ""
    lines = [f"{measured_on(doc)}, pipelined worker{over}:", ""]
    rows = []
    for index, phase in enumerate(runs[0].phases):

        def of(key: str, index: int = index) -> Figure:
            return Figure.of(getattr(r.phases[index], key) for r in runs)

        own = phase.name == "flood, own key"
        ahead_p99, ahead_max = of("batches_ahead_p99"), of("batches_ahead_max")
        ahead = f"{ahead_p99.high:.0f} / {ahead_max.high:.0f}"
        batch = (
            of("batch_p99_ms").text(decimal())
            if all(r.phases[index].batch_p99_ms is not None for r in runs)
            else "-"
        )
        rows.append(
            [
                phase.name,
                f"{of('jobs').median:.0f}",
                of("p50_ms").text(decimal()),
                of("p99_ms").text(decimal(), own),
                of("max_ms").text(decimal()),
                f"**{ahead}**" if own else ahead,
                batch,
            ]
        )
    header = ["phase", "steady jobs", "p50 ms", "p99 ms", "max ms", "batches ahead, p99 / max"]
    lines += table([*header, "batch p99 ms"], "lrrrrrr", rows)
    if len(runs) > 1:
        lines += ["", "(Batches ahead: the most of any run.)"]
    return lines


def headline_fairness(results: Results) -> str:
    runs = results.typed("fairness", Report).runs
    flood = results["fairness"]["settings"]["flood_jobs"]
    own = max(r.phases[1].batches_ahead_max for r in runs)
    shared = max(r.phases[2].batches_ahead_max for r in runs)
    return (
        f"- **Fair share.** A tenant that floods a lane with {flood:,} jobs holds back another "
        f"tenant's job by **{batches(own)} at most** (behind a shared queue: up to "
        f"{batches(shared)})."
    )


if __name__ == "__main__":
    raise SystemExit(main())
