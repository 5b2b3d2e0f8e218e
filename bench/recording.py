"""How long the worker's result write takes: one statement per batch against one per job.

For each database (a scratch SQLite file; with ``--postgres``, a scratch
database of the PostgreSQL at 127.0.0.1:5432), ``--batches`` batches of
``--size`` running jobs are finished through ``Recorder.finish``, alternating
the batched write and the per-job write, side by side in one run, for small
outputs and for 384-float embeddings (what minilm returns).

    python -m bench.recording [--size 256] [--batches 20] [--postgres]
                              [--out bench/results/recording.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from sqlalchemy import insert

from bench import results
from bench.report import Figure, Results, Spread, measured_on, table, times
from core.db import migrate
from core.db.keys import create_key
from core.db.schema import Job, make_engine, make_sessionmaker, utcnow
from harness.services import postgres_database
from workers.gpu.recorder import Outcome, Recorder

OUTPUTS: dict[str, Any] = {"small": {"cost": 1}, "embedding": [0.123456789] * 384}


@dataclass
class Row:
    database: str  # sqlite | postgresql
    outputs: str  # small | embedding
    per_job_ms: Spread  # a batch's results, one statement per job
    batched_ms: Spread  # one statement per batch
    ratio: Spread  # batch by batch


@dataclass
class Report:
    """bench/results/recording.json besides its head (bench.report.typed reads it)."""

    rows: list[Row]


RESULT = Report


@contextlib.contextmanager
def database(kind: str) -> Iterator[str]:
    if kind == "postgresql":
        with postgres_database() as url:
            yield url
        return
    with tempfile.TemporaryDirectory(prefix="ferry-bench-recording-") as tmp:
        yield f"sqlite:///{Path(tmp) / 'ferry.db'}"


def measure(url: str, size: int, batches: int) -> dict[tuple[str, str], list[float]]:
    """Ms per batch, batch by batch, by (output kind, write)."""
    migrate.upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    recorder = Recorder(sessions)
    with sessions() as session:
        key = create_key(session, "bench").id
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(batches):
            for kind, output in OUTPUTS.items():
                for write in ("batched", "per job"):
                    ids = [str(uuid.uuid4()) for _ in range(size)]
                    with sessions.begin() as session:
                        session.execute(
                            insert(Job),
                            [
                                {
                                    "id": job_id,
                                    "api_key_id": key,
                                    "model": "minilm",
                                    "priority": "normal",
                                    "input": "x",
                                    "cost": 1,
                                    "status": "running",
                                }
                                for job_id in ids
                            ],
                        )
                    outcomes = [
                        Outcome(i, "succeeded", output=output, inference_ms=3.0) for i in ids
                    ]
                    batched = write == "batched"
                    with mock.patch(
                        "workers.gpu.recorder._batched_writes", lambda _d, b=batched: b
                    ):
                        started = time.perf_counter()
                        written = recorder.finish(outcomes, utcnow(), "bench", size)
                        elapsed = time.perf_counter() - started
                    assert len(written) == size
                    times.setdefault((kind, write), []).append(elapsed * 1000.0)
    finally:
        engine.dispose()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/recording.json"))
    args = parser.parse_args(argv)
    head = results.provenance("recording", argv)
    print(f"{'database':11} {'outputs':10} {'per job':>9} {'batched':>9} {'ratio':>6}")
    rows = []
    for kind in ("sqlite", "postgresql") if args.postgres else ("sqlite",):
        with database(kind) as url:
            times = measure(url, args.size, args.batches)
        for output in OUTPUTS:
            one, each = times[(output, "batched")], times[(output, "per job")]
            # Batch by batch: the two writes of a pair ran one after the other.
            ratios = [e / o for e, o in zip(each, one, strict=True)]
            rows.append(
                {
                    "database": kind,
                    "outputs": output,
                    "per_job_ms": results.spread(each),
                    "batched_ms": results.spread(one),
                    "ratio": results.spread(ratios),
                }
            )
            print(
                f"{kind:11} {output:10} {statistics.median(each):>7.1f}ms "
                f"{statistics.median(one):>7.1f}ms {statistics.median(ratios):>5.2f}x"
            )
    settings = {"size": args.size, "batches": args.batches}
    results.write(args.out, {"rows": rows}, settings=settings, head=head)
    print(f"wrote {args.out}")
    return 0


# --- its tables (python -m bench.render) --------------------------------------------------


def render_recording(results: Results) -> list[str]:
    doc, report = results["recording"], results.typed("recording", Report)
    settings = doc["settings"]
    names = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
    outputs = {"small": "small", "embedding": "384 floats"}
    rows = [
        [
            names[row.database],
            outputs[row.outputs],
            f"{row.per_job_ms.median:.1f} ms",
            f"{row.batched_ms.median:.1f} ms",
            Figure.summary(row.ratio).text(times()),
        ]
        for row in report.rows
    ]
    return [
        f"{measured_on(doc)}; median of "
        f"{settings['batches']} batches of {settings['size']} (the ratio: batch by batch, "
        "median and range):",
        "",
        *table(
            ["database", "outputs", "one statement per job", "one per batch", "ratio"],
            "llrrr",
            rows,
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
