# ruff: noqa: RUF001
"""Redis failover under load: how long until jobs flow again, and what it cost.

Each round starts a Redis primary, a replica and three sentinels (redis-servers
on loopback ports), a fresh PostgreSQL database, the API in uvicorn and a sim
worker that reach Redis through the sentinels, and the reconciler as beat
runs it; submits jobs at a steady rate; SIGKILLs the primary; and waits for
every accepted job. Recorded per round: the time from the kill until a job
accepted after it had finished, the submissions refused, the jobs the
reconciler enqueued again (accepted while no primary answered, or lost in the
asynchronous replication), and lost and run-twice counts (both must be 0).

    python -m bench.sentinel [--rounds 3] [--out bench/results/sentinel.json]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import results
from bench.report import Results, Spread, measured_on, table
from core.config.settings import Settings
from harness.sentinel import DOWN_AFTER_MS, SentinelRedis, failover_under_load
from harness.services import migrated_postgres_database


@dataclass
class Round:
    sent: int
    accepted: int
    refused: int
    requeued: int  # enqueued again by the reconciler
    statuses: dict[str, int]  # the accepted jobs' ends
    lost: int
    run_twice: int
    recovered_s: float | None  # None: jobs never flowed again


@dataclass
class Report:
    """bench/results/sentinel.json besides its head (bench.report.typed reads it)."""

    runs: list[Round]
    recovered_s: Spread
    lost: int
    run_twice: int


RESULT = Report


def one_round(load_s: float, kill_at_s: float, rate: float) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="ferry-sentinel-") as tmp,
        SentinelRedis(Path(tmp) / "redis") as sentinel,
        migrated_postgres_database() as database,
    ):
        settings = Settings(
            redis_sentinels=sentinel.sentinels,
            database_url=database,
            data_dir=Path(tmp),
            key_prefix="sentinel",
            models="sim",
            model_parameters={"sim": {"latency_base_ms": 5.0, "latency_per_cost_ms": 0.1}},
            batch_max_size=8,
            reconcile_grace_s=2.0,
        )
        run = failover_under_load(sentinel, settings, load_s=load_s, kill_at_s=kill_at_s, rate=rate)
    statuses: dict[str, int] = {}
    for job in run.jobs.values():
        statuses[job.status] = statuses.get(job.status, 0) + 1
    return {
        "sent": run.sent,
        "accepted": len(run.accepted),
        "refused": len(run.refused),
        "requeued": run.requeued,
        "statuses": statuses,
        "lost": len(run.accepted) - statuses.get("succeeded", 0),
        "run_twice": sum(1 for job in run.jobs.values() if job.attempts > 1),
        "recovered_s": run.recovered_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-s", type=float, default=14.0)
    parser.add_argument("--kill-at-s", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=25.0)
    parser.add_argument("--out", type=Path, default=results.RESULTS / "sentinel.json")
    args = parser.parse_args(argv)
    head = results.provenance("sentinel", argv)
    runs = results.repeated(
        args.rounds,
        lambda: one_round(args.load_s, args.kill_at_s, args.rate),
        lambda run: print(
            f"  recovered in {run['recovered_s']:.1f} s; accepted {run['accepted']} of "
            f"{run['sent']}, requeued {run['requeued']}, lost {run['lost']}, "
            f"run twice {run['run_twice']}",
            flush=True,
        ),
    )
    results.write(
        args.out,
        {
            "runs": runs,
            "recovered_s": results.spread([r["recovered_s"] or float("nan") for r in runs]),
            "lost": sum(r["lost"] for r in runs),
            "run_twice": sum(r["run_twice"] for r in runs),
        },
        settings={
            "rounds": args.rounds,
            "load_s": args.load_s,
            "kill_at_s": args.kill_at_s,
            "rate_per_s": args.rate,
            "down_after_ms": DOWN_AFTER_MS,
            "reconcile_interval_s": 1.0,
            "reconcile_grace_s": 2.0,
        },
        head=head,
    )
    print(f"wrote {args.out}")


# --- its tables (python -m bench.render) --------------------------------------------------


def render_sentinel(results: Results) -> list[str]:
    doc, report = results["sentinel"], results.typed("sentinel", Report)
    settings = doc["settings"]
    runs = report.runs
    recovered = report.recovered_s
    rows = [
        [
            str(number),
            f"{run.recovered_s:.1f}" if run.recovered_s is not None else "never",
            f"{run.accepted:,} of {run.sent:,}",
            f"{run.refused:,}",
            f"{run.requeued:,}",
            f"{run.lost:,}",
            f"{run.run_twice:,}",
        ]
        for number, run in enumerate(runs, 1)
    ]
    return [
        f"{measured_on(doc)}: {settings['rate_per_s']:g} "
        f"jobs/s for {settings['load_s']:g} s, the primary killed at "
        f"{settings['kill_at_s']:g} s (the sentinels call it down after "
        f"{settings['down_after_ms']:,} ms). Jobs flowed again **{recovered.median:.1f} s** "
        f"after the kill (median of {len(runs)}; {recovered.min:.1f}–{recovered.max:.1f}); "
        f"**{report.lost:,} lost, {report.run_twice:,} run twice**.",
        "",
        *table(
            [
                "round",
                "flowing again (s)",
                "accepted",
                "refused",
                "enqueued again",
                "lost",
                "run twice",
            ],
            "rrrrrrr",
            rows,
        ),
    ]


if __name__ == "__main__":
    main()
