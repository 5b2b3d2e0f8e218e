"""What a Redis Cluster does for Ferry's throughput: the Redis work of jobs of three models on
one Redis and on a three-primary Redis Cluster whose primaries hold one model each, side by
side in one run.

Per target and round, ``--jobs`` jobs of three models (in turn) from eight API keys are
enqueued as the API's group commit enqueues them (``Scripts.enqueue_all``, a pipeline per
``--group`` jobs), then each model's consumer reads and acknowledges them in batches of up to
``--batch`` as a worker does (``StreamConsumer.read`` and ``ack``, with the completion
``PUBLISH``). Each node's CPU (``INFO cpu``) is read before and after. Redis runs commands on
one core, so one Redis carries at most one core over its CPU per job, and a cluster as many
jobs per second as its busiest primary allows.

    python -m bench.cluster [--jobs 6000] [--group 16] [--batch 32] [--rounds 3]
                            [--out bench/results/cluster.json]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from bench import results
from bench.report import Figure, Results, Spread, decimal, measured_on, percent, table, times
from core.streams.protocol import JobMessage, Scripts, done_channel
from core.streams.target import RedisTarget
from harness.cluster import ClusterRedis, models_on_every_shard
from harness.services import started_redis
from workers.gpu.consumer import StreamConsumer

TENANTS = 8


@dataclass
class TargetRun:
    """One round on one target (one Redis, or the cluster)."""

    cpu_s: dict[int, float]  # by node's port
    cpu_us_per_job: float
    busiest_share: float
    saturates_at: float


@dataclass
class Round:
    one: TargetRun
    cluster: TargetRun
    ratio: float  # the cluster's jobs/s at saturation over one Redis's


@dataclass
class Target:
    cpu_us_per_job: Spread
    busiest_share: Spread
    saturates_at: Spread


@dataclass
class Report:
    """bench/results/cluster.json besides its head (bench.report.typed reads it)."""

    runs: list[Round]
    one: Target
    cluster: Target
    ratio: Spread


RESULT = Report


def cpu_s(port: int) -> float:
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def one_pass(
    target: RedisTarget,
    ports: list[int],
    prefix: str,
    models: list[str],
    jobs: int,
    group: int,
    batch: int,
) -> dict[str, Any]:
    """Enqueue ``jobs`` jobs and drain them; each node's CPU seconds, by port."""
    client = target.client()
    scripts = Scripts(client)
    consumers = {model: StreamConsumer(client, prefix, model, "bench") for model in models}
    for consumer in consumers.values():
        consumer.ensure_groups()
    messages = [
        (models[n % len(models)], JobMessage(f"job-{n}", "normal", 8, 0, tenant=f"k{n % TENANTS}"))
        for n in range(jobs)
    ]
    before = {port: cpu_s(port) for port in ports}
    for start in range(0, jobs, group):
        pipe = client.pipeline(transaction=False)
        scripts.enqueue_all(pipe, prefix, messages[start : start + group])
        scripts.execute(pipe)
    drained = 0
    while drained < jobs:
        read = 0
        for consumer in consumers.values():
            entries = consumer.read(batch, None)
            if entries:
                ids = ",".join(entry.message.job_id for entry in entries)
                consumer.ack(entries, publish=(done_channel(prefix), ids))
                read += len(entries)
        if not read:
            raise AssertionError(f"drained {drained} of {jobs} jobs, then nothing to read")
        drained += read
    spent = {port: cpu_s(port) - before[port] for port in ports}
    client.close()
    return {"cpu_s": spent}


def figures(spent: dict[int, float], jobs: int) -> dict[str, float]:
    busiest = max(spent.values())
    total = sum(spent.values())
    return {
        "cpu_us_per_job": total / jobs * 1e6,
        "busiest_share": busiest / total if total else float("nan"),
        "saturates_at": jobs / busiest if busiest else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=6000)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cluster.json"))
    args = parser.parse_args(argv)
    head = results.provenance("cluster", argv)
    rounds: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="ferry-bench-cluster-") as tmp,
        started_redis(Path(tmp) / "single") as single_url,
        ClusterRedis(Path(tmp) / "cluster") as cluster,
    ):
        models = models_on_every_shard(cluster, "bench")
        single = RedisTarget(single_url)
        sharded = RedisTarget(cluster.url, cluster=True, broker_url="unused://")
        single_port = urlsplit(single_url).port or 6379
        for number in range(args.rounds):
            found: dict[str, Any] = {}
            # Side by side: the two targets take turns, in a different order each round.
            order = [("one", single, [single_port]), ("cluster", sharded, cluster.ports)]
            for name, target, ports in order if number % 2 == 0 else order[::-1]:
                # The hash tags are the models' names, so every round's keys land alike.
                done = one_pass(
                    target, ports, f"bench{number}", models, args.jobs, args.group, args.batch
                )
                found[name] = {**done, **figures(done["cpu_s"], args.jobs)}
            found["ratio"] = found["cluster"]["saturates_at"] / found["one"]["saturates_at"]
            rounds.append(found)
            print(
                f"round {number + 1}: one Redis {found['one']['cpu_us_per_job']:.1f} µs/job, "
                f"saturates at {found['one']['saturates_at']:,.0f} jobs/s; cluster "
                f"{found['cluster']['cpu_us_per_job']:.1f} µs/job, busiest primary "
                f"{found['cluster']['busiest_share']:.0%}, saturates at "
                f"{found['cluster']['saturates_at']:,.0f} jobs/s ({found['ratio']:.2f}x)"
            )
    summary = {
        name: {
            key: results.spread([r[name][key] for r in rounds])
            for key in ("cpu_us_per_job", "busiest_share", "saturates_at")
        }
        for name in ("one", "cluster")
    }
    settings = {
        "jobs": args.jobs,
        "group": args.group,
        "batch": args.batch,
        "models": len(models),
        "primaries": len(cluster.ports),
        "tenants": TENANTS,
    }
    results.write(
        args.out,
        {"runs": rounds, **summary, "ratio": results.spread([r["ratio"] for r in rounds])},
        settings=settings,
        head=head,
    )
    print(f"wrote {args.out}")
    return 0


# --- its tables (python -m bench.render) --------------------------------------------------


def render_cluster(results: Results) -> list[str]:
    doc, report = results["cluster"], results.typed("cluster", Report)
    settings = doc["settings"]
    runs = report.runs
    names = {"one": "one Redis", "cluster": f"a cluster of {settings['primaries']} primaries"}
    rows = [
        [
            names[name],
            Figure.summary(target.cpu_us_per_job).text(decimal(1)),
            Figure.summary(target.busiest_share).text(percent()),
            Figure.summary(target.saturates_at).text(decimal(), bold=name == "cluster"),
        ]
        for name, target in (("one", report.one), ("cluster", report.cluster))
    ]
    return [
        f"{measured_on(doc)}: {settings['jobs']:,} jobs of "
        f"{settings['models']} models from {settings['tenants']} keys, enqueued in groups of "
        f"{settings['group']} and drained in batches of up to {settings['batch']}, on each "
        f"target in turn, {len(runs)} rounds (median and range). The cluster carries "
        f"**{Figure.summary(report.ratio).text(times())}** the jobs per second of one Redis.",
        "",
        *table(
            [
                "Redis",
                "CPU per job (µs, all nodes)",
                "busiest node's share",
                "saturates at (jobs/s)",
            ],
            "lrrr",
            rows,
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
