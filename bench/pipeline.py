# ruff: noqa: RUF001
"""The pipelined worker against the plain one: how long the device waits for Python.

Three workers drain the same queue:

* **plain**: read, decide, claim, prepare, compute, record, one after the other;
* **record**: batch N is recorded (the result write, the acknowledgement,
  webhooks) on a thread of its own while batch N + 1 runs (``FERRY_PIPELINE``);
* **three-stage**: also, batch N + 1 is decided, claimed and prepared while
  batch N computes, and launched the moment N is done
  (``FERRY_PIPELINE_PREPARE``).

For each, on one fresh ``ferry up`` stack with no worker of its own,
``--jobs`` sim jobs are queued, then a ``ferry worker --model sim`` starts and
drains them. The sim model stands in for a fast GPU: a batch takes 5 ms +
0.1 ms per unit of cost on the device (32 jobs of cost 4: 17.8 ms), about
what all-MiniLM-L6-v2 takes on a data-centre GPU, and preparing it costs the
CPU 0.1 ms per input (a tokeniser's work), done as busy work.

* **jobs/s**: jobs / (last finished - first started), from the results table;
* **device idle**: 1 - (the device's busy time, from the worker's
  ``ferry_worker_compute_seconds_total``) / that same span.

``--one-stack`` (the smoke run's) drains every mode of a round on one stack,
each with a worker of its own: quicker, but a mode then starts from what the
previous one left in Redis and the database, so its figures are not comparable.

    python -m bench.pipeline [--jobs 6000] [--postgres] [--rounds 3] [--one-stack]
                             [--out bench/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sqlalchemy

from bench import results
from bench.fairness import submit_many
from bench.report import Figure, Results, Spread, decimal, measured_on, percent, table, times
from ferry.local_redis import free_port
from harness.services import postgres_database
from harness.stack import FerryUp, compute_seconds

SIM = {
    "FERRY_SIM_LATENCY_BASE_MS": "5",
    "FERRY_SIM_LATENCY_PER_COST_MS": "0.1",
    "FERRY_SIM_PREPARE_MS_PER_ITEM": "0.1",
}
COST = 4  # per job: a full batch of 32 computes in 5 + 0.1 x 4 x 32 = 17.8 ms
# Mode: (FERRY_PIPELINE, FERRY_PIPELINE_PREPARE).
MODES = {"plain": (False, False), "record": (True, False), "three-stage": (True, True)}


@dataclass
class ModeResult:
    mode: str
    database: str
    round: int
    jobs: int
    seconds: float
    jobs_per_s: float
    compute_s: float
    device_idle: float
    mean_batch_size: float


@dataclass
class Report:
    """bench/results/pipeline.json besides its head (bench.report.typed reads it)."""

    modes: list[ModeResult]
    # Per database, each worker's jobs/s over the same round's plain worker's.
    summary: dict[str, dict[str, Spread]]


RESULT = Report


@contextlib.contextmanager
def started_stack(database_url: str | None) -> Iterator[tuple[FerryUp, sqlalchemy.Engine]]:
    """A fresh ``ferry up`` with no worker of its own, and an engine on its database."""
    with tempfile.TemporaryDirectory(prefix="ferry-bench-pipeline-") as tmp:
        root = Path(tmp)
        url = database_url or f"sqlite:///{root / 'ferry.db'}"
        extra = {"FERRY_DATABASE_URL": database_url} if database_url else {}
        stack = FerryUp(
            root,
            celery=False,
            FERRY_MODELS="",
            FERRY_RATE_LIMIT="100000/second",
            FERRY_MAX_OUTSTANDING_JOBS="100000",
            **SIM,
            **extra,
        )
        engine = sqlalchemy.create_engine(url)
        try:
            stack.start()
            yield stack, engine
        finally:
            engine.dispose()
            stack.stop(stack.process, 60)


def drain(
    stack: FerryUp, engine: sqlalchemy.Engine, mode: str, jobs: int, database: str, round_: int
) -> ModeResult:
    """``jobs`` queued on ``stack``, then drained by a worker of ``mode`` started for them."""
    pipeline, prepare = MODES[mode]
    ids = submit_many(stack.base, stack.token, jobs, cost=COST)
    port = free_port()
    # The pipeline is the worker's setting: a stack the modes share starts one per mode.
    stack.env.update(
        FERRY_PIPELINE=str(pipeline).lower(), FERRY_PIPELINE_PREPARE=str(prepare).lower()
    )
    worker = stack.spawn(
        [sys.executable, "-m", "ferry", "worker", "--model", "sim", "--metrics-port", str(port)]
    )
    try:
        until = time.monotonic() + 900
        while True:
            with engine.connect() as conn:
                left = conn.execute(
                    sqlalchemy.text(
                        "SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')"
                    )
                ).scalar_one()
            if not left:
                break
            if time.monotonic() > until:
                raise RuntimeError(f"{left} jobs left unfinished")
            time.sleep(0.2)
        compute_s = compute_seconds(port, "sim")
        with engine.connect() as conn:
            first, last, batches = conn.execute(
                sqlalchemy.text(
                    "SELECT min(started_at), max(finished_at), count(DISTINCT batch_id) "
                    "FROM jobs WHERE id IN :ids"
                ).bindparams(sqlalchemy.bindparam("ids", expanding=True)),
                {"ids": ids},
            ).one()
    finally:
        stack.stop(worker, 60)
    seconds = (_aware(last) - _aware(first)).total_seconds()
    return ModeResult(
        mode=mode,
        database=database,
        round=round_,
        jobs=jobs,
        seconds=round(seconds, 3),
        jobs_per_s=round(jobs / seconds, 1),
        compute_s=round(compute_s, 3),
        device_idle=round(1.0 - compute_s / seconds, 3),
        mean_batch_size=round(jobs / batches, 2),
    )


def _aware(value: Any) -> dt.datetime:
    parsed = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def against_plain(modes: list[ModeResult], database: str) -> dict[str, dict[str, float]]:
    """Each mode's jobs/s over the plain worker's of the same round: median and range."""
    plain = {m.round: m.jobs_per_s for m in modes if m.database == database and m.mode == "plain"}
    ratios: dict[str, list[float]] = {}
    for m in modes:
        if m.database == database and m.round in plain:
            ratios.setdefault(f"{m.mode}_vs_plain", []).append(m.jobs_per_s / plain[m.round])
    return {name: results.spread(values) for name, values in ratios.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=6000)
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="also run on a scratch database of the PostgreSQL at 127.0.0.1:5432",
    )
    parser.add_argument("--rounds", type=int, default=3, help="repeats of every run")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--one-stack",
        action="store_true",
        help="every mode of a round on one stack (quicker; the figures are not comparable)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/pipeline.json"))
    args = parser.parse_args(argv)
    head = results.provenance("pipeline", argv)
    databases = ("sqlite", "postgresql") if args.postgres else ("sqlite",)
    modes: list[ModeResult] = []
    # Round by round, each mode in turn: a slow spell of the machine weighs on all alike.
    for number in range(1, args.rounds + 1):
        for database in databases:
            names = args.modes.split(",")
            # A fresh database and stack for each mode, or (--one-stack) one for them all.
            for group in [names] if args.one_stack else [[name] for name in names]:
                with contextlib.ExitStack() as scope:
                    url = scope.enter_context(postgres_database()) if database != "sqlite" else None
                    stack, engine = scope.enter_context(started_stack(url))
                    for name in group:
                        modes.append(drain(stack, engine, name, args.jobs, database, number))
                        print(f"  {asdict(modes[-1])}", flush=True)
    summary = {database: against_plain(modes, database) for database in databases}
    settings = {
        "jobs": args.jobs,
        "cost": COST,
        "rounds": args.rounds,
        "one_stack": args.one_stack,
        "sim": SIM,
    }
    results.write(
        args.out,
        {"modes": [asdict(m) for m in modes], "summary": summary},
        settings=settings,
        head=head,
    )
    print(
        f"{'database':11} {'mode':12} {'round':>5} {'jobs/s':>8} {'device idle':>12} {'batch':>6}"
    )
    for result in modes:
        print(
            f"{result.database:11} {result.mode:12} {result.round:>5} {result.jobs_per_s:>8.1f} "
            f"{result.device_idle:>6.1%} {result.mean_batch_size:>6.1f}"
        )
    print(f"wrote {args.out}")
    return 0


# --- its tables (python -m bench.render) --------------------------------------------------


def pipeline_figures(report: Report) -> dict[tuple[str, str], dict[str, Figure]]:
    """Per (database, mode): jobs/s, idle, batch, and jobs/s over the same round's plain."""
    plain = {(m.database, m.round): m.jobs_per_s for m in report.modes if m.mode == "plain"}
    found: dict[tuple[str, str], dict[str, list[float]]] = {}
    for m in report.modes:
        values = found.setdefault((m.database, m.mode), {})
        values.setdefault("jobs_per_s", []).append(m.jobs_per_s)
        values.setdefault("device_idle", []).append(m.device_idle)
        values.setdefault("mean_batch_size", []).append(m.mean_batch_size)
        values.setdefault("ceiling", []).append(m.jobs_per_s / (m.jobs / m.compute_s))
        values.setdefault("vs_plain", []).append(m.jobs_per_s / plain[(m.database, m.round)])
    return {key: {k: Figure.of(v) for k, v in values.items()} for key, values in found.items()}


def render_pipeline(results: Results) -> list[str]:
    doc, report = results["pipeline"], results.typed("pipeline", Report)
    figures = pipeline_figures(report)
    rounds = max(m.round for m in report.modes)
    over = f"; median of {rounds} rounds (min–max)" if rounds > 1 else ""
    lines = [f"{measured_on(doc)}{over}:", ""]
    names = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
    rows = []
    for (database, mode), f in figures.items():
        best = mode == "three-stage"
        rows.append(
            [
                names[database],
                mode,
                f["jobs_per_s"].text(decimal()),
                f["vs_plain"].text(times(), best),
                f["ceiling"].text(percent()),
                f["device_idle"].text(percent(1), best),
                f"{f['mean_batch_size'].median:.1f}",
            ]
        )
    header = ["database", "worker", "jobs/s", "× plain", "of the device's ceiling"]
    return lines + table([*header, "device idle", "batch"], "llrrrrr", rows)


def headline_pipeline(results: Results) -> str:
    figures = pipeline_figures(results.typed("pipeline", Report))
    sqlite = figures[("sqlite", "three-stage")]
    postgres = figures.get(("postgresql", "three-stage"))
    on_postgres = f" ({postgres['vs_plain'].text(times())} on PostgreSQL)" if postgres else ""
    plain_idle = figures[("sqlite", "plain")]["device_idle"]
    return (
        f"- **The worker's pipeline** drains a queue {sqlite['vs_plain'].text(times(), True)} "
        f"faster on SQLite{on_postgres} than a worker that does each step in turn: a fast "
        f"stand-in GPU idles {sqlite['device_idle'].text(percent(), True)} of the time instead "
        f"of {plain_idle.text(percent())}."
    )


if __name__ == "__main__":
    raise SystemExit(main())
