# ruff: noqa: RUF001
"""The GPU benchmark: each model alone, then through the whole stack, on one device.

1. **raw**: the runtime alone in this process (``minilm`` on the corpus,
   inputs sorted by length; ``resnet50`` on generated JPEGs, random weights),
   items per second at each batch size.
2. **stack, saturated**: a fresh ``ferry up`` (its own Redis, SQLite) with no
   worker; ``--jobs`` jobs are queued through ``POST /v1/jobs``, then one
   ``ferry worker`` starts and drains them. Jobs per second = jobs / (first
   started -> last finished), and its share of the best raw rate.
3. **stack, 70 % load**: the same stack, jobs sent open loop at 70 % of the
   saturated rate for ``--seconds``; p50 and p99 of accepted -> finished.
4. **stack, plain worker**: the saturated run again (half the jobs) with a
   worker that overlaps nothing (``FERRY_PIPELINE=false``,
   ``FERRY_PIPELINE_PREPARE=false``): its jobs per second, and for both
   workers the GPU's idle share, 1 - (the stream's busy time, timed by CUDA
   events, from ``ferry_worker_compute_seconds_total``) / the span.

    python -m bench.gpu [--quick] [--jobs 20000] [--seconds 20] [--out bench/results/gpu.json]

``--quick`` runs a few hundred jobs at small batch sizes (a smoke run, on a
CPU too). On a CUDA device the models run in fp16.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import results
from bench.corpus import load_corpus
from bench.e2e import _ts, job_rows, wait_done
from bench.generation import GENERATION_SYSTEMS
from bench.generation import Report as GenerationReport
from bench.quantiles import nearest_rank
from bench.report import (
    Doc,
    Figure,
    Results,
    day,
    measured_on,
    percent,
    table,
    times,
    verdict,
)
from ferry.local_redis import free_port
from harness import webclient
from harness.stack import FerryUp, batch_figures, compute_seconds

DECODE_THREADS = min(16, os.cpu_count() or 4)


@dataclass
class ModelResult:
    model: str
    raw_by_batch: dict[int, float] = field(default_factory=dict)
    raw_best: float = 0.0
    stack_jobs_per_s: float = 0.0
    stack_share_of_raw: float = 0.0
    stack_device_idle: float = 0.0
    plain_jobs_per_s: float = 0.0
    plain_device_idle: float = 0.0
    load_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    # Each saturated run's batches, from the worker's /metrics (harness.stack.batch_figures).
    stack_batches: dict[str, Any] = field(default_factory=dict)
    plain_batches: dict[str, Any] = field(default_factory=dict)
    # Wall seconds of each phase, to plan a run cut at a time limit.
    phase_s: dict[str, float] = field(default_factory=dict)


@dataclass
class Report:
    device: str
    precision: str
    models: list[ModelResult]


# What bench/results/gpu.json holds besides its head (bench.report.typed reads it).
RESULT = Report


def images(count: int, seed: int = 0) -> list[str]:
    """Noise JPEGs of a few camera-like sizes, base64."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    made = []
    for _ in range(count):
        width, height = rng.choice([(640, 480), (320, 240), (500, 375)])
        pixels = np.random.default_rng(rng.randrange(2**32)).integers(
            0, 256, (height, width, 3), dtype=np.uint8
        )
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
        made.append(base64.b64encode(buffer.getvalue()).decode())
    return made


def inputs_for(model: str, count: int) -> list[Any]:
    if model == "minilm":
        texts = load_corpus().texts
        return [texts[i % len(texts)] for i in range(count)]
    pool = images(64)
    return [pool[i % len(pool)] for i in range(count)]


def raw(
    model: str, device: str, precision: str, sizes: tuple[int, ...], items: int
) -> dict[int, float]:
    from backends.catalog import load_runtime, repository_for
    from core.config.settings import Settings

    settings = Settings(
        device=device,
        precision=precision,
        batch_max_size=max(sizes),
        model_parameters={"resnet50": {"random_weights": True, "decode_threads": DECODE_THREADS}},
    )
    runtime: Any = load_runtime(repository_for(settings)[model], settings)
    data = inputs_for(model, items)
    if model == "minilm":
        data.sort(key=len)
    rates = {}
    for size in sizes:
        runtime.run(data[:size])  # this shape's first run pays for allocation
        started = time.perf_counter()
        for start in range(0, len(data), size):
            runtime.run(data[start : start + size])
        rates[size] = round(len(data) / (time.perf_counter() - started), 1)
        print(f"  {model} raw, batch {size:>4}: {rates[size]:>10.1f} items/s", flush=True)
    return rates


def submit(base: str, token: str, model: str, data: list[Any], threads: int = 16) -> list[str]:
    headers = {"Authorization": f"Bearer {token}"}

    def send(chunk: list[Any]) -> list[str]:
        ids = []
        with webclient.client(base_url=base, headers=headers, timeout=60) as client:
            for item in chunk:
                response = client.post("/v1/jobs", json={"model": model, "input": item})
                if response.status_code != 202:
                    raise RuntimeError(f"refused: {response.status_code} {response.text[:200]}")
                ids.append(response.json()["id"])
        return ids

    with ThreadPoolExecutor(threads) as pool:
        return [
            job for ids in pool.map(send, [data[i::threads] for i in range(threads)]) for job in ids
        ]


def paced(base: str, token: str, model: str, data: list[Any], rate: float) -> list[str]:
    """Each job sent at its time, ``rate`` per second, whatever the answers (open loop)."""
    headers = {"Authorization": f"Bearer {token}"}
    begin = time.monotonic()
    local = threading.local()

    def send(number: int) -> str:
        time.sleep(max(0.0, begin + number / rate - time.monotonic()))
        if not hasattr(local, "client"):
            local.client = webclient.client(base_url=base, headers=headers, timeout=60)
        response = local.client.post(
            "/v1/jobs", json={"model": model, "input": data[number % len(data)]}
        )
        if response.status_code != 202:
            raise RuntimeError(f"refused: {response.status_code} {response.text[:200]}")
        return str(response.json()["id"])

    with ThreadPoolExecutor(64) as pool:
        return list(pool.map(send, range(len(data))))


def stack(
    model: str,
    precision: str,
    jobs: int,
    seconds: float,
    result: ModelResult,
    save: Callable[[], None],
) -> None:
    settings = {
        "FERRY_MODELS": "",
        "FERRY_RATE_LIMIT": "1000000/second",
        "FERRY_MAX_OUTSTANDING_JOBS": str(max(10 * jobs, 10_000)),
        "FERRY_RESNET50_RANDOM_WEIGHTS": "true",
        "FERRY_PRECISION": precision,
        "FERRY_BATCH_MAX_SIZE": str(max(result.raw_by_batch, key=result.raw_by_batch.__getitem__)),
        "FERRY_PREFETCH": "1024",
        # The same decode threads as the raw run, so the two compare.
        "FERRY_RESNET50_DECODE_THREADS": str(DECODE_THREADS),
    }
    # FerryUp passes no FERRY_* variable on: the kit's repository must be named.
    if os.environ.get("FERRY_MODEL_REPOSITORY"):
        settings["FERRY_MODEL_REPOSITORY"] = os.environ["FERRY_MODEL_REPOSITORY"]
    with tempfile.TemporaryDirectory(prefix=f"ferry-bench-gpu-{model}-") as tmp:
        up = FerryUp(Path(tmp), celery=False, **settings)
        worker = None
        try:
            up.start()
            db = up.root / "ferry.db"
            began = time.monotonic()
            rate, idle, worker, result.stack_batches = saturate(up, model, inputs_for(model, jobs))
            result.phase_s["saturated"] = round(time.monotonic() - began, 1)
            result.stack_jobs_per_s, result.stack_device_idle = rate, idle
            result.stack_share_of_raw = round(result.stack_jobs_per_s / result.raw_best, 3)
            print(f"  {model} stack, saturated: {rate} jobs/s, GPU idle {idle:.1%}", flush=True)
            save()
            began = time.monotonic()
            result.load_per_s = round(0.7 * result.stack_jobs_per_s, 1)
            count = max(1, int(result.load_per_s * seconds))
            sent = paced(up.base, up.token, model, inputs_for(model, count), result.load_per_s)
            wait_done(db, sent, timeout_s=600)
            rows = job_rows(db, sent, "created_at, finished_at")
            latencies = sorted((_ts(f) - _ts(c)) * 1000.0 for c, f in rows)
            result.p50_ms = round(nearest_rank(latencies, 0.5), 1)
            result.p99_ms = round(nearest_rank(latencies, 0.99), 1)
            print(
                f"  {model} stack, {result.load_per_s}/s: p50 {result.p50_ms} ms, "
                f"p99 {result.p99_ms} ms",
                flush=True,
            )
            result.phase_s["load"] = round(time.monotonic() - began, 1)
            save()
            began = time.monotonic()
            up.stop(worker, 60)
            rate, idle, worker, result.plain_batches = saturate(
                up,
                model,
                inputs_for(model, max(1, jobs // 2)),
                FERRY_PIPELINE="false",
                FERRY_PIPELINE_PREPARE="false",
            )
            result.phase_s["plain"] = round(time.monotonic() - began, 1)
            result.plain_jobs_per_s, result.plain_device_idle = rate, idle
            print(f"  {model} stack, plain worker: {rate} jobs/s, GPU idle {idle:.1%}", flush=True)
        finally:
            up.stop(worker, 60)
            up.stop(up.process, 60)


def saturate(
    up: FerryUp, model: str, data: list[Any], **worker_settings: str
) -> tuple[float, float, subprocess.Popen[str], dict[str, Any]]:
    """Queue ``data``, then start a worker to drain it: jobs/s, the device's idle share, the
    worker, and its batches (how many, their size, each stage's time).

    ``worker_settings``: FERRY_* variables for this worker only.
    """
    queued = submit(up.base, up.token, model, data)
    port = free_port()
    stack_env = up.env
    up.env = {**stack_env, **worker_settings}
    try:
        worker = up.spawn(
            [sys.executable, "-m", "ferry", "worker", "--model", model, "--metrics-port", str(port)]
        )
    finally:
        up.env = stack_env
    wait_done(up.root / "ferry.db", queued, timeout_s=600)
    first, last = job_rows(up.root / "ferry.db", queued, "min(started_at), max(finished_at)")[0]
    span = _ts(last) - _ts(first)
    busy = compute_seconds(port, model)
    figures = batch_figures(port, model)
    return round(len(queued) / span, 1), round(max(0.0, 1.0 - busy / span), 3), worker, figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--models", default="minilm,resnet50")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu.json"))
    args = parser.parse_args(argv)
    head = results.provenance("gpu", argv)
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    precision = "fp16" if cuda else "fp32"
    sizes = (1, 8) if args.quick else (1, 8, 32, 64, 128, 256)
    jobs = 200 if args.quick else args.jobs
    seconds = 5.0 if args.quick else args.seconds
    os.environ["FERRY_DEVICE"] = device
    measured: list[ModelResult] = []
    report = Report(
        device=torch.cuda.get_device_name(0) if cuda else "cpu",
        precision=precision,
        models=measured,
    )
    settings = {
        "quick": args.quick,
        "jobs": jobs,
        "seconds": seconds,
        "models": args.models.split(","),
        "raw_batch_sizes": list(sizes),
    }

    def save() -> None:  # after every phase: a run cut short keeps what it measured
        results.write(args.out, asdict(report), settings=settings, head=head)

    for model in args.models.split(","):
        result = ModelResult(model)
        measured.append(result)
        items = 64 if args.quick else (4096 if model == "minilm" else 2048)
        began = time.monotonic()
        result.raw_by_batch = raw(model, device, precision, sizes, items)
        result.raw_best = max(result.raw_by_batch.values())
        result.phase_s["raw"] = round(time.monotonic() - began, 1)
        save()
        stack(model, precision, jobs if model == "minilm" else jobs // 4, seconds, result, save)
        save()
    for r in measured:
        print(
            f"{r.model}: raw best {r.raw_best}/s; stack {r.stack_jobs_per_s}/s "
            f"({r.stack_share_of_raw:.0%} of raw, GPU idle {r.stack_device_idle:.1%}; "
            f"plain worker {r.plain_jobs_per_s}/s, idle {r.plain_device_idle:.1%}); "
            f"at {r.load_per_s}/s p50 {r.p50_ms} ms, p99 {r.p99_ms} ms"
        )
    print(f"wrote {args.out}")
    return 0


# --- its tables (python -m bench.render) --------------------------------------------------


def headline_gpu(results: Results) -> str:
    gpu, generation = results["gpu"], results["generation_gpu"]
    report = results.typed("gpu", Report)
    minilm = next(model for model in report.models if model.model == "minilm")
    share, rate, _ = GPU_TARGETS["minilm"]
    met = minilm.stack_share_of_raw >= (share or 0) and minilm.stack_jobs_per_s >= rate
    targets = results.typed("generation_gpu", GenerationReport).targets

    def ratio(system: str) -> str:
        found = targets[system]
        return (
            f"{Figure.summary(found.ratio).text(times())} {GENERATION_SYSTEMS[system]} "
            f"(target {found.tokens_per_s_ratio_at_least:g}×: {verdict(found.met)})"
        )

    model = generation["settings"]["model"]
    return (
        f"- **On a GPU** ({report.device}, {day(gpu)}, the first run, one round): "
        f"all-MiniLM-L6-v2 in {report.precision} through the whole stack at "
        f"**{minilm.stack_jobs_per_s:,.0f}** jobs/s, "
        f"{percent(1)(minilm.stack_share_of_raw)} of the runtime's raw ceiling (target "
        f"{percent()(share or 0)} and {rate:,.0f}/s: {verdict(met)}). Generation "
        f"({generation['settings']['precision']}, a {model['layers']}-layer "
        f"{model['arch']}-shaped model, {generation['settings']['requests']} requests at once): "
        f"Ferry's output tokens/s are {ratio('single')} and {ratio('static')}."
    )


# The targets on an H200, per model: (share of raw at least, jobs/s at least, p99 ms at most).
GPU_TARGETS = {"minilm": (0.8, 10_000.0, None), "resnet50": (None, 2_000.0, 100.0)}


def render_gpu(results: Results) -> list[str]:
    doc, report = results["gpu"], results.typed("gpu", Report)
    sizes = [int(size) for size in doc["settings"]["raw_batch_sizes"]]
    found = {model.model: model for model in report.models}
    raw_rows = [[name, *(f"{model.raw_by_batch[b]:,.0f}" for b in sizes)]
                for name, model in found.items()]  # fmt: skip
    stack_rows = [
        [
            name,
            f"**{model.stack_jobs_per_s:,.0f}**",
            percent(1)(model.stack_share_of_raw),
            percent(1)(model.stack_device_idle),
            f"{model.plain_jobs_per_s:,.0f}",
            percent(1)(model.plain_device_idle),
            f"{model.load_per_s:,.0f}/s: {model.p50_ms:,.0f} ms, {model.p99_ms:,.0f} ms",
        ]
        for name, model in found.items()
    ]
    targets = []
    for name, (share, rate, p99) in GPU_TARGETS.items():
        model = found.get(name)
        if model is None:
            targets.append(f"- {name}: not measured in this run.")
            continue
        parts, met = [], True
        if share is not None:
            parts.append(f"≥ {percent()(share)} of raw ({percent(1)(model.stack_share_of_raw)})")
            met &= model.stack_share_of_raw >= share
        parts.append(f"≥ {rate:,.0f} jobs/s ({model.stack_jobs_per_s:,.0f})")
        met &= model.stack_jobs_per_s >= rate
        if p99 is not None:
            parts.append(f"p99 ≤ {p99:,.0f} ms at 70 % load ({model.p99_ms:,.0f} ms)")
            met &= model.p99_ms <= p99
        targets.append(f"- {name}: {', '.join(parts)}: {verdict(met)}.")

    def batches(found: Doc) -> str:
        stages = ", ".join(f"{k} {v:,.1f}" for k, v in found["stage_ms_per_batch"].items())
        return f"{found['batches']:,} batches of {found['mean_batch']:g} jobs on average ({stages})"

    # Files before the first run's did not record the worker's batches.
    recorded = [
        f"- {name}'s batches, ms a batch in each stage: pipelined, "
        f"{batches(model.stack_batches)}; plain, {batches(model.plain_batches)}."
        for name, model in found.items()
        if model.stack_batches and model.plain_batches
    ]
    return [
        f"{measured_on(doc)}; {report.precision} on "
        f"{report.device}, one run. Raw, the runtime alone, items/s by batch size:",
        "",
        *table(["model", *map(str, sizes)], "l" + "r" * len(sizes), raw_rows),
        "",
        "Through the whole stack (one worker), jobs/s; the GPU's idle share; "
        "open-loop load at 70 % of saturation: p50 and p99 of accepted → finished:",
        "",
        *table(
            ["model", "saturated", "share of raw", "GPU idle", "plain worker", "its GPU idle",
             "70 % load: p50, p99"],
            "lrrrrrl",
            stack_rows,
        ),
        "",
        *recorded,
        *targets,
    ]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
