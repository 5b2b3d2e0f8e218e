"""Peers side by side: the raw model, Ray Serve's ``@serve.batch``, Celery, Ferry.

One run, one corpus, one load, one client. In each of ``--repeats`` repeats
(3), one after the other, each system started afresh and stopped after:

* **raw ceiling**: the minilm runtime alone in this process (no queue, no
  HTTP), as ``bench/clients.py`` takes it: the sample (``--texts``, the
  first 1,000 paragraphs of ``bench/corpus.py``'s corpus) sorted by token
  count, in batches of one size. The first repeat is preceded by
  ``bench/clients.py``'s sweep over ``--raw-threads`` (torch threads: 1, as
  each serving system's model has) and ``--raw-sizes`` (batch sizes); every
  repeat then times the sweep's best configuration, the ceiling the same
  repeat's systems are divided by. Its p50 / p99 are those of one batch's
  compute, not of a request. Beside it,
  the same threads on the sample as it comes (unsorted) in batches of
  ``--ray-batch``: what batching in arrival order, each batch padded to its
  longest text, leaves of the ceiling.
* **Ray Serve**: a local Ray cluster (``ray.init(num_cpus=2)``, no
  dashboard), one replica (``num_cpus=1``, ``max_ongoing_requests`` = the
  clients) whose ``@serve.batch(max_batch_size=--ray-batch,
  batch_wait_timeout_s=--ray-wait-ms / 1000)`` method runs the same minilm
  runtime (``backends``' sentence-transformers backend, ``--threads`` torch
  threads) on each batch, behind Serve's HTTP proxy on loopback: ``POST /``
  with ``{"input": text}``, answered with the embedding.
* **Celery**: a worker process (prefork, ``--celery-concurrency`` children,
  each with the runtime loaded once at its start, ``--threads`` torch
  threads) on a Redis broker and result backend of its own (the harness's
  ``started_redis``; a reachable one when no redis-server can be started),
  one task per request, Celery's defaults otherwise. Celery speaks no HTTP:
  each client calls ``task.delay(text).get()``.
* **Ferry**: ``ferry up`` as ``bench/clients.py`` starts it (SQLite,
  ``FERRY_MODELS=minilm``, ``FERRY_CPU_THREADS=--threads``, the limits
  raised), measured twice on the same stack: submit ``POST /v1/jobs`` and
  long-poll ``GET /v1/jobs/{id}?wait=--wait`` until the job is terminal; and
  the one round trip ``POST /v1/jobs?wait=--wait`` (a 202, when the wait
  runs out first, long-polled as above).

The load is the same for every system: ``--clients`` closed-loop clients,
each a thread of this process running the same loop (take the sample's next
text, call the system, wait for the embedding, check it has 384 numbers,
call again at once), for ``--warmup`` s, then ``--duration`` s measured. A
request counts when its answer arrives within the measured window; its
latency is the client's, from the call to the embedding in hand. The
systems' order turns round from one repeat to the next.

Per system and repeat: requests/s, its share of the same repeat's raw
ceiling, p50 and p99 latency, the mean batch the answers report (Ray's
batch as the deployment saw it, Ferry's ``batch.size``; Celery runs one text
per task), errors. Each figure is then the median of the repeats and their
range (min-max).

    python -m bench.peers [--duration 20] [--warmup 10] [--repeats 3]
                          [--clients 64] [--texts 1000] [--threads 1]
                          [--raw-threads 1] [--raw-sizes 16,32,64]
                          [--ray-batch 32] [--ray-wait-ms 5]
                          [--celery-concurrency 2] [--wait 30]
                          [--systems ray,celery,ferry] [--set FERRY_NAME=VALUE ...]
                          [--quiet-below L] [--out bench/results/peers.json]
    make bench-peers  # installs the bench extras (ray[serve]) first

Needs ``ray[serve]`` (``pip install -c constraints.txt -c bench/constraints.txt
-e '.[bench]'``; ``python -m bench all`` skips this benchmark without it) and a
redis-server. The defaults take about 12 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import results
from bench.api import TERMINAL
from bench.clients import (
    MODEL,
    Raw,
    RawModel,
    _terminate,
    ferry_settings,
    load_average,
    measure_raw,
    set_threads,
    started_ferry,
    wait_quiet,
)
from bench.report import Doc, Figure, Results, Spread, counted, decimal, measured_on, percent, table
from harness import webclient
from harness.stack import FerryUp

DIMENSIONS = 384  # all-MiniLM-L6-v2's embedding
SYSTEMS = ("ray", "celery", "ferry")
# What each measured system is called in the results, in the table's order.
MEASURED = ("ray", "celery", "ferry-longpoll", "ferry-wait")
CELERY_TASK = "peers.embed"
CELERY_QUEUE = "ferry-peers"
JOIN_TIMEOUT_S = 120.0
ERROR_PAUSE_S = 0.05  # a client whose call failed waits this long before the next

# A client's call: one text in, the batch size its answer reports (None: not said);
# raises when the answer is not a 384-number embedding.
Call = Callable[[str], int | None]
# Per client thread: its call and what closes its connection.
Connect = Callable[[], tuple[Call, Callable[[], None]]]


@dataclass(frozen=True)
class Load:
    clients: int
    warmup_s: float
    duration_s: float


@dataclass
class Measured:
    """One system under the closed-loop load, in one repeat."""

    system: str
    requests: int = 0  # answered within the measured window
    seconds: float = 0.0
    per_s: float = 0.0
    ratio: float = float("nan")  # per_s / the same repeat's raw ceiling
    p50_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    mean_batch: float | None = None  # over the answers that report one
    errors: int = 0  # failed calls within the window
    error_examples: list[str] = field(default_factory=list)
    startup_s: float | None = None  # started until it answered a first request
    load_average_at_end: list[float] = field(default_factory=list)
    error: str | None = None  # the system could not be measured


# --- the load: one closed-loop client, whatever the system ------------------------------


def closed_loop(
    system: str,
    connect: Connect,
    texts: list[str],
    load: Load,
    window: Callable[[str], None] | None = None,
) -> Measured:
    """``load.clients`` threads, each calling the system again as soon as it answered.

    ``window("begin")`` and ``window("end")`` are called as the measured window opens
    and closes (to take what else is measured over the same span)."""
    stop = threading.Event()
    turn = itertools.count()
    taking = threading.Lock()
    # (started, ended, batch) per answer; (ended, why) per failed call.
    answers: list[tuple[float, float, int | None]] = []
    failures: list[tuple[float, str]] = []

    def client() -> None:
        call, close = connect()
        try:
            while not stop.is_set():
                with taking:
                    text = texts[next(turn) % len(texts)]
                started = time.perf_counter()
                try:
                    batch = call(text)
                except Exception as exc:
                    failures.append((time.perf_counter(), repr(exc)[:300]))
                    time.sleep(ERROR_PAUSE_S)
                    continue
                answers.append((started, time.perf_counter(), batch))
        finally:
            close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(load.clients)]
    for thread in threads:
        thread.start()
    time.sleep(load.warmup_s)
    if window is not None:
        window("begin")
    begin = time.perf_counter()
    time.sleep(load.duration_s)
    end = time.perf_counter()
    if window is not None:
        window("end")
    stop.set()
    until = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(timeout=max(0.0, until - time.monotonic()))
    return tally(system, answers, failures, begin, end)


def tally(
    system: str,
    answers: list[tuple[float, float, int | None]],
    failures: list[tuple[float, str]],
    begin: float,
    end: float,
) -> Measured:
    inside = [a for a in answers if begin <= a[1] < end]
    latencies = sorted(1000.0 * (ended - started) for started, ended, _ in inside)
    sizes = [batch for _, _, batch in inside if batch]
    failed = [why for ended, why in failures if begin <= ended < end]
    seconds = end - begin
    measured = Measured(
        system=system,
        requests=len(inside),
        seconds=round(seconds, 2),
        per_s=round(len(inside) / seconds, 2),
        mean_batch=round(statistics.fmean(sizes), 2) if sizes else None,
        errors=len(failed),
        error_examples=sorted(set(failed))[:3],
        load_average_at_end=load_average(),
    )
    if len(latencies) >= 2:
        cuts = statistics.quantiles(latencies, n=100, method="inclusive")
        measured.p50_ms, measured.p99_ms = round(cuts[49], 1), round(cuts[98], 1)
        measured.mean_ms = round(statistics.fmean(latencies), 1)
    return measured


def embedding(values: Any) -> None:
    if not isinstance(values, list) or len(values) != DIMENSIONS:
        raise ValueError(f"not a {DIMENSIONS}-number embedding: {str(values)[:120]}")


def http_connect(make: Callable[[Any], Call], timeout_s: float, base: str = "") -> Connect:
    """Each client thread with an HTTP connection of its own, kept alive."""

    def connect() -> tuple[Call, Callable[[], None]]:

        client = webclient.client(base_url=base, timeout=timeout_s)
        return make(client), client.close

    return connect


def first_call(connect: Connect, text: str) -> None:
    """One request, answered: the system is up with its model loaded."""
    call, close = connect()
    try:
        call(text)
    finally:
        close()


# --- the raw ceiling --------------------------------------------------------------------


def raw_pass(model: RawModel, ordered: list[str], threads: int, size: int) -> Measured:
    """One pass through the sorted sample in batches of ``size``: texts/s and batch times."""
    set_threads(threads)
    middle = len(ordered) // 2
    model.runtime.run(ordered[middle : middle + size])  # the thread pool resized
    took = []
    for i in range(0, len(ordered), size):
        started = time.perf_counter()
        model.runtime.run(ordered[i : i + size])
        took.append(time.perf_counter() - started)
    set_threads(1)  # idle beside the systems
    batch_ms = [1000.0 * t for t in took]
    cuts = statistics.quantiles(batch_ms, n=100, method="inclusive") if len(took) > 1 else None
    return Measured(
        system="raw",
        requests=len(ordered),
        seconds=round(sum(took), 2),
        per_s=round(len(ordered) / sum(took), 2),
        ratio=1.0,
        p50_ms=round(cuts[49], 1) if cuts else round(batch_ms[0], 1),
        p99_ms=round(cuts[98], 1) if cuts else round(batch_ms[0], 1),
        mean_ms=round(statistics.fmean(batch_ms), 1),
        mean_batch=round(len(ordered) / len(took), 2),
        load_average_at_end=load_average(),
    )


# --- Ray Serve --------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    load: Load
    threads: int  # the serving systems' torch threads
    ray_batch: int
    ray_wait_s: float
    celery_concurrency: int
    wait_s: int  # Ferry's long-poll
    extra: dict[str, str]


def ray_deployment(options: Options) -> Any:
    """The Serve application: minilm behind ``@serve.batch``, one replica."""
    # Typed as Any: mypy runs where ray is not installed as well as where it is.
    serve: Any = importlib.import_module("ray.serve")

    threads = options.threads

    class Embedder:
        def __init__(self) -> None:
            self.model = RawModel(threads)

        @serve.batch(max_batch_size=options.ray_batch, batch_wait_timeout_s=options.ray_wait_s)
        async def embed(self, texts: list[str]) -> list[dict[str, Any]]:
            outputs = self.model.runtime.run(texts)
            return [{"embedding": out, "batch": len(texts)} for out in outputs]

        async def __call__(self, request: Any) -> dict[str, Any]:
            body = await request.json()
            answer: dict[str, Any] = await self.embed(body["input"])
            return answer

    deployment = serve.deployment(
        Embedder,
        num_replicas=1,
        # Room for every client's request in the replica, or no batch could fill.
        max_ongoing_requests=max(options.ray_batch, options.load.clients),
        ray_actor_options={"num_cpus": 1},
    )
    return deployment.bind()


@contextlib.contextmanager
def ray_serve(options: Options) -> Iterator[str]:
    """A local Ray cluster serving the deployment on loopback; its URL. Shut down after."""
    from ferry.local_redis import free_port

    ray: Any = importlib.import_module("ray")
    serve: Any = importlib.import_module("ray.serve")

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report home from the bench
    ours = signal.getsignal(signal.SIGTERM)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    # ray.init puts in a SIGTERM handler that exits at once: this bench's own unwinds, so
    # whatever runs (this cluster, a Ferry stack, a Celery worker) is stopped first.
    signal.signal(signal.SIGTERM, ours)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_deployment(options), name="peers", route_prefix="/")
        yield f"http://127.0.0.1:{port}/"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def ray_call(url: str) -> Callable[[Any], Call]:
    def make(client: Any) -> Call:
        def call(text: str) -> int | None:
            response = client.post(url, json={"input": text})
            response.raise_for_status()
            answer = response.json()
            embedding(answer["embedding"])
            return int(answer["batch"])

        return call

    return make


def run_ray(options: Options, texts: list[str]) -> Measured:
    started = time.monotonic()
    with ray_serve(options) as url:
        connect = http_connect(ray_call(url), 60.0)
        first_call(connect, texts[0])
        startup = round(time.monotonic() - started, 1)
        print(f"  Ray Serve up after {startup:.0f} s, {url}", flush=True)
        measured = closed_loop("ray", connect, texts, options.load)
    measured.startup_s = startup
    return measured


# --- Celery -----------------------------------------------------------------------------


_celery_model: list[RawModel] = []  # the worker child's runtime, loaded at its start


def celery_app(broker: str, threads: int) -> Any:
    """The Celery app, the same in this process and in the worker: one task, minilm."""
    from celery import Celery

    app = Celery("ferry-peers", broker=broker, backend=broker, set_as_current=False)
    app.conf.update(task_default_queue=CELERY_QUEUE, result_expires=600)

    # Not shared: a later app of this process (the next repeat's) registers its own.
    @app.task(name=CELERY_TASK, shared=False)
    def embed(text: str) -> list[float]:
        if not _celery_model:
            _celery_model.append(RawModel(threads))
        out: list[float] = _celery_model[0].runtime.run([text])[0]
        return out

    return app


def celery_worker() -> None:
    """The worker process's entry (``python -c``): the broker, children and threads from
    FERRY_PEERS_BROKER, FERRY_PEERS_CONCURRENCY and FERRY_PEERS_THREADS."""
    from celery.signals import worker_process_init

    threads = int(os.environ["FERRY_PEERS_THREADS"])
    app = celery_app(os.environ["FERRY_PEERS_BROKER"], threads)

    def load(**_: Any) -> None:
        _celery_model.append(RawModel(threads))

    worker_process_init.connect(load, weak=False)
    app.worker_main(
        [
            "worker",
            "--pool",
            "prefork",
            "--concurrency",
            os.environ["FERRY_PEERS_CONCURRENCY"],
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
        ]
    )


@contextlib.contextmanager
def celery_broker() -> Iterator[str]:
    """A Redis of this run's own; where no redis-server can be started, the one reachable."""
    from harness.services import ServiceMissing, reachable_redis, started_redis

    with (
        tempfile.TemporaryDirectory(prefix="ferry-bench-peers-redis-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        try:
            url = stack.enter_context(started_redis(Path(tmp)))
        except ServiceMissing:
            found = reachable_redis()
            if found is None:
                raise
            url = found
        yield url


@contextlib.contextmanager
def celery_worker_running(broker: str, options: Options) -> Iterator[Path]:
    """The Celery worker process, stopped after; yields the file its output goes to (a
    file, not a pipe: a pipe nobody reads would stall the worker once full)."""
    env = {
        **os.environ,
        "FERRY_PEERS_BROKER": broker,
        "FERRY_PEERS_THREADS": str(options.threads),
        "FERRY_PEERS_CONCURRENCY": str(options.celery_concurrency),
    }
    with tempfile.TemporaryDirectory(prefix="ferry-bench-peers-celery-") as tmp:
        log = Path(tmp) / "worker.log"
        with log.open("w") as sink:
            process = subprocess.Popen(
                [sys.executable, "-c", "from bench.peers import celery_worker; celery_worker()"],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                text=True,
            )
        try:
            yield log
        finally:
            FerryUp.stop(process, 60)


def celery_connect(app: Any) -> Connect:
    task = app.tasks[CELERY_TASK]

    def connect() -> tuple[Call, Callable[[], None]]:
        def call(text: str) -> int | None:
            embedding(task.delay(text).get(timeout=120))
            return 1

        return call, lambda: None

    return connect


def run_celery(options: Options, texts: list[str]) -> Measured:
    started = time.monotonic()
    with celery_broker() as broker, celery_worker_running(broker, options) as log:
        app = celery_app(broker, options.threads)
        try:
            connect = celery_connect(app)
            try:
                first_call(connect, texts[0])
            except Exception as exc:
                output = log.read_text(errors="replace")[-3000:]
                exc.add_note("the Celery worker's last output:\n" + output)
                raise
            startup = round(time.monotonic() - started, 1)
            print(f"  Celery up after {startup:.0f} s", flush=True)
            measured = closed_loop("celery", connect, texts, options.load)
        finally:
            app.close()
    measured.startup_s = startup
    return measured


# --- Ferry ------------------------------------------------------------------------------


def ferry_call(token: str, wait_s: int, one_trip: bool) -> Callable[[Any], Call]:
    headers = {"Authorization": f"Bearer {token}"}

    def make(client: Any) -> Call:
        def call(text: str) -> int | None:
            body = {"model": MODEL, "input": text}
            params = {"wait": wait_s} if one_trip else {}
            response = client.post("/v1/jobs", json=body, params=params, headers=headers)
            if response.status_code not in (200, 202):
                raise RuntimeError(f"{response.status_code} {response.text[:200]}")
            job = response.json()
            while job["status"] not in TERMINAL:
                response = client.get(
                    f"/v1/jobs/{job['id']}", params={"wait": wait_s}, headers=headers
                )
                response.raise_for_status()
                job = response.json()
            if job["status"] != "succeeded":
                raise RuntimeError(f"the job {job['status']}: {job.get('error')}")
            embedding(job["output"])
            return int(job["batch"]["size"]) if job.get("batch") else None

        return call

    return make


def run_ferry(options: Options, texts: list[str], order: list[str]) -> dict[str, Measured]:
    settings = ferry_settings(options.threads, options.extra)
    first = {"model": MODEL, "input": texts[0]}
    found: dict[str, Measured] = {}
    with started_ferry(settings, first, "ferry-bench-peers-") as up:
        print(f"  Ferry up after {up.startup_s:.0f} s, {up.stack.base}", flush=True)
        for system in order:
            make = ferry_call(up.stack.token, options.wait_s, system == "ferry-wait")
            connect = http_connect(make, options.wait_s + 30, up.stack.base)
            found[system] = closed_loop(system, connect, texts, options.load)
            found[system].startup_s = up.startup_s
    return found


# --- one repeat, the report -------------------------------------------------------------


def line(m: Measured) -> str:
    if m.error:
        return f"{m.system:15} failed: {m.error.splitlines()[0]}"
    p50 = f"{m.p50_ms:.0f}" if m.p50_ms is not None else "-"
    p99 = f"{m.p99_ms:.0f}" if m.p99_ms is not None else "-"
    batch = f"{m.mean_batch:.1f}" if m.mean_batch is not None else "-"
    errors = f"  !! {m.errors} errors {m.error_examples[:1]}" if m.errors else ""
    return (
        f"{m.system:15} {m.per_s:7.1f}/s ({100 * m.ratio:5.1f} % of raw)  p50 {p50} ms  "
        f"p99 {p99} ms  batch {batch}{errors}"
    )


def failed(system: str, exc: Exception) -> Measured:
    why = "\n".join([f"{type(exc).__name__}: {exc}"[-3000:], *getattr(exc, "__notes__", [])])
    print(f"  {system}: failed: {why.splitlines()[0]}", flush=True)
    return Measured(system=system, error=why)


def one_repeat(
    number: int,
    options: Options,
    systems: list[str],
    model: RawModel,
    ordered: list[str],
    texts: list[str],
    ceiling: tuple[int, int],
) -> dict[str, Any]:
    """The raw ceiling, then each system in an order turned by ``number``."""
    raw = raw_pass(model, ordered, *ceiling)
    print(f"  {line(raw)}", flush=True)
    # What batching in arrival order costs the model alone: each batch padded to its longest.
    arrival = raw_pass(model, texts, ceiling[0], options.ray_batch)
    arrival.system, arrival.ratio = "raw-arrival", round(arrival.per_s / raw.per_s, 4)
    print(f"  {line(arrival)}", flush=True)
    turned = systems[number % len(systems) :] + systems[: number % len(systems)]
    ferry_order = ["ferry-longpoll", "ferry-wait"][:: 1 if number % 2 == 0 else -1]
    measured: dict[str, Measured] = {}
    for system in turned:
        print(f"  {system}", flush=True)
        names = ferry_order if system == "ferry" else [system]
        try:
            if system == "ferry":
                found = run_ferry(options, texts, ferry_order)
            else:
                found = {system: (run_ray if system == "ray" else run_celery)(options, texts)}
        except Exception as exc:
            found = {name: failed(name, exc) for name in names}
        for m in found.values():
            if not m.error:
                m.ratio = round(m.per_s / raw.per_s, 4)
                print(f"    {line(m)}", flush=True)
        measured.update(found)
    order = [name for s in turned for name in (ferry_order if s == "ferry" else [s])]
    return {
        "repeat": number + 1,
        "order": order,
        "raw": asdict(raw),
        "raw_arrival": asdict(arrival),
        "systems": {name: asdict(measured[name]) for name in MEASURED if name in measured},
    }


@dataclass
class SystemSummary:
    """One system over the repeats: each figure's median and range."""

    per_s: Spread
    ratio: Spread  # of the raw ceiling
    p50_ms: Spread
    p99_ms: Spread
    mean_batch: Spread
    repeats: int  # measured
    failed: int
    errors: int  # failed calls within the measured windows
    startup_s: Spread | None  # None: the raw model


@dataclass
class Repeat:
    repeat: int
    order: list[str]  # the systems in the order this repeat measured them
    raw: Measured
    raw_arrival: Measured
    systems: dict[str, Measured]


@dataclass
class Report:
    """bench/results/peers.json besides its head (bench.report.typed reads it)."""

    sample: dict[str, float]  # the corpus sample: texts, tokens mean and max
    raw_sweep: Raw
    ceiling: dict[str, int]  # the raw ceiling's threads and batch
    repeats: list[Repeat]
    summary: dict[str, SystemSummary]
    flags: list[str]
    quiet_wait: Any  # how long the run waited for a quiet machine, or None
    elapsed_s: float
    load_average_at_end: list[float]


RESULT = Report


def summarise(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    def over(found: list[dict[str, Any]], key: str) -> dict[str, float]:
        return results.spread([float(f[key]) for f in found if f.get(key) is not None])

    summary: dict[str, Any] = {}
    names = [
        "raw",
        "raw-arrival",
        *(n for n in MEASURED if any(n in r["systems"] for r in repeats)),
    ]
    for name in names:
        found = [r["systems"].get(name) or r.get(name.replace("-", "_")) for r in repeats]
        ok = [f for f in found if f and not f.get("error")]
        summary[name] = {
            **{key: over(ok, key) for key in ("per_s", "ratio", "p50_ms", "p99_ms", "mean_batch")},
            "repeats": len(ok),
            "failed": len(found) - len(ok),
            "errors": sum(int(f["errors"]) for f in ok),
            "startup_s": None if name.startswith("raw") else over(ok, "startup_s"),
        }
    return summary


def flags(repeats: list[dict[str, Any]], quiet: dict[str, Any] | None) -> list[str]:
    found = []
    if quiet is not None and not quiet["met"]:
        found.append(f"the load average was not below {quiet['below']} before the run")
    for r in repeats:
        for name, m in r["systems"].items():
            where = f"repeat {r['repeat']}, {name}"
            if m.get("error"):
                found.append(f"{where}: failed: {m['error'].splitlines()[0]}")
            elif m["errors"]:
                found.append(f"{where}: {m['errors']} failed calls, e.g. {m['error_examples'][0]}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64, help="closed-loop clients")
    parser.add_argument("--texts", type=int, default=1000, help="the corpus sample's size")
    parser.add_argument("--threads", type=int, default=1, help="each system's torch threads")
    # One, the serving systems' threads: on 2 busy cores a pool of two stalls whenever
    # anything else runs, and the ceiling would measure the neighbours.
    parser.add_argument("--raw-threads", default="1", help="the raw sweep's torch threads")
    parser.add_argument("--raw-sizes", default="16,32,64", help="the raw sweep's batch sizes")
    parser.add_argument("--ray-batch", type=int, default=32, help="@serve.batch's max size")
    parser.add_argument("--ray-wait-ms", type=float, default=5.0, help="@serve.batch's wait")
    parser.add_argument("--celery-concurrency", type=int, default=2, help="worker children")
    parser.add_argument("--wait", type=int, default=30, help="Ferry's long-poll, seconds")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of them")
    results.add_set_option(parser, "the Ferry stacks")
    parser.add_argument(
        "--quiet-below", type=float, default=0.0, help="first wait for a 1-min load below this"
    )
    parser.add_argument("--quiet-timeout", type=float, default=2400.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/peers.json"))
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - set(SYSTEMS):
        parser.error(f"--systems: one of {', '.join(SYSTEMS)}")
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args, argv, systems)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, argv: list[str] | None, systems: list[str]) -> int:
    from bench.corpus import load_corpus

    quiet = wait_quiet(args.quiet_below, args.quiet_timeout) if args.quiet_below else None
    started = time.monotonic()
    head = results.provenance("peers", argv)
    options = Options(
        load=Load(args.clients, args.warmup, args.duration),
        threads=args.threads,
        ray_batch=args.ray_batch,
        ray_wait_s=args.ray_wait_ms / 1000.0,
        celery_concurrency=args.celery_concurrency,
        wait_s=args.wait,
        extra=dict(args.set),
    )
    raw_threads = [int(n) for n in args.raw_threads.split(",")]
    sizes = [int(n) for n in args.raw_sizes.split(",")]
    corpus = load_corpus()
    texts, costs = corpus.texts[: args.texts], corpus.costs[: args.texts]
    ordered = [t for _, t in sorted(zip(costs, texts, strict=True), key=lambda p: (p[0], p[1]))]
    print(f"{len(texts)} texts, mean {statistics.fmean(costs):.1f} tokens", flush=True)
    model = RawModel(max(raw_threads))
    sweep = measure_raw(model, texts, costs, raw_threads, sizes)
    ceiling = (sweep.ceiling_threads, sweep.ceiling_batch)
    print(f"ceiling: {ceiling[0]} thread(s), batch {ceiling[1]}", flush=True)
    repeats = []
    for number in range(args.repeats):
        print(f"repeat {number + 1} of {args.repeats}", flush=True)
        repeats.append(one_repeat(number, options, systems, model, ordered, texts, ceiling))
    summary = summarise(repeats)
    report: dict[str, Any] = {
        "sample": {
            "texts": len(texts),
            "corpus_texts": len(corpus.texts),
            "tokens_mean": round(statistics.fmean(costs), 1),
            "tokens_max": max(costs),
        },
        "raw_sweep": asdict(sweep),
        "ceiling": {"threads": ceiling[0], "batch": ceiling[1]},
        "repeats": repeats,
        "summary": summary,
        "flags": flags(repeats, quiet),
        "quiet_wait": quiet,
        "elapsed_s": round(time.monotonic() - started, 1),
        "load_average_at_end": load_average(),
    }
    settings = {
        "clients": args.clients,
        "client": "one thread per client in the bench's process: httpx for HTTP, "
        "task.delay(text).get() for Celery",
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "repeats": args.repeats,
        "texts": args.texts,
        "systems": systems,
        "threads": args.threads,
        "raw_threads": raw_threads,
        "raw_sizes": sizes,
        "ray": {
            "version": _version("ray"),
            "max_batch_size": args.ray_batch,
            "batch_wait_timeout_s": options.ray_wait_s,
            "replicas": 1,
            "max_ongoing_requests": max(args.ray_batch, args.clients),
        },
        "celery": {
            "version": _version("celery"),
            "pool": "prefork",
            "concurrency": args.celery_concurrency,
        },
        "ferry": {"settings": ferry_settings(args.threads, options.extra), "wait_s": args.wait},
    }
    print("\nmedian (min-max) of the repeats:")
    for name, s in summary.items():
        print(
            f"  {name:15} {s['per_s']['median']:7.1f}/s  {100 * s['ratio']['median']:5.1f} % "
            f"of raw  p50 {s['p50_ms']['median']} ms  p99 {s['p99_ms']['median']} ms  "
            f"({s['repeats']} repeats, {s['failed']} failed)"
        )
    for flag in report["flags"]:
        print(f"FLAG: {flag}")
    results.write(args.out, report, settings=settings, head=head)
    print(f"wrote {args.out} ({report['elapsed_s']:.0f} s)")
    return 1 if any(s["failed"] for s in summary.values()) else 0


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# --- its tables (python -m bench.render) --------------------------------------------------


PEERS = (
    ("raw", "raw model, no serving layer"),
    ("raw-arrival", "raw model, unsorted"),
    ("ray", "Ray Serve, `@serve.batch`"),
    ("celery", "Celery, a task per request"),
    ("ferry-longpoll", "Ferry, submit + long-poll"),
    ("ferry-wait", "Ferry, `POST /v1/jobs?wait=`"),
)


PEERS_HEADER = (
    "system", "what it batches", "requests/s", "% of the raw ceiling", "p50", "p99", "mean batch",
)  # fmt: skip


def peers_batching(doc: Doc, report: Report, name: str) -> str:
    ray, ceiling = doc["settings"]["ray"], report.ceiling
    children = doc["settings"]["celery"]["concurrency"]
    return {
        "raw": f"texts sorted by length, batches of {ceiling['batch']}, "
        + counted(ceiling["threads"], "torch thread", "torch threads"),
        "raw-arrival": f"texts as they come, batches of {ray['max_batch_size']}, each padded "
        "to its longest",
        "ray": f"up to {ray['max_batch_size']} requests or "
        f"{1000 * ray['batch_wait_timeout_s']:g} ms, one replica",
        "celery": "none: one text a task, "
        + counted(children, "worker process", "worker processes"),
    }.get(name, f"its scheduler: what waits, grouped by cost, {ferry_batch_limit(doc)}")


def ferry_batch_limit(doc: Doc) -> str:
    """Ferry's largest batch as the run set it: a FERRY_BATCH_MAX_SIZE it was given, else
    the size each worker derives from its model's latency (the default)."""
    size = doc["settings"]["ferry"]["settings"].get("FERRY_BATCH_MAX_SIZE")
    if size is not None:
        return f"up to {size}"
    return "up to the size its worker derives from the model's latency (the default)"


def render_peers(results: Results) -> list[str]:
    doc, report = results["peers"], results.typed("peers", Report)
    summary, settings = report.summary, doc["settings"]
    ms = decimal(0, " ms")
    rows = []
    for name, label in PEERS:
        found = summary.get(name)
        if found is None:
            continue
        if not found.repeats:
            rows.append([label, peers_batching(doc, report, name), "failed", "", "", "", ""])
            continue
        ferry = name.startswith("ferry")
        latency = "¹" if name.startswith("raw") else ""
        rows.append(
            [
                label,
                peers_batching(doc, report, name),
                Figure.summary(found.per_s).text(decimal(1), ferry),
                Figure.summary(found.ratio).text(percent(1), ferry),
                Figure.summary(found.p50_ms).text(ms) + latency,
                Figure.summary(found.p99_ms).text(ms) + latency,
                f"{found.mean_batch.median:.1f}",
            ]
        )
    errors = {n: s.errors for n, s in summary.items() if s.errors}
    failed = {n: s.failed for n, s in summary.items() if s.failed}
    lines = [
        f"{measured_on(doc)}, load average "
        f"{doc['machine']['load_average_at_start'][0]:.1f} at the start; "
        f"{report.sample['texts']:,} paragraphs of the corpus (mean {report.sample['tokens_mean']}"
        f" tokens); {settings['clients']} closed-loop clients, {settings['warmup_s']:g} s of "
        f"warm-up then {settings['duration_s']:g} s measured, "
        f"{counted(settings['repeats'], 'repeat', 'repeats')}; each system's model with "
        f"{counted(settings['threads'], 'torch thread', 'torch threads')}; Ray "
        f"{settings['ray']['version']}, "
        f"Celery {settings['celery']['version']}:",
        "",
        *table(PEERS_HEADER, "llrrrrr", rows),
        "",
        "¹ The raw model's p50 and p99 are one batch's compute, not a request's latency.",
    ]
    if errors or failed:
        lines += [
            "",
            "Failed calls within the measured windows: "
            + ", ".join(f"{n} {c:,}" for n, c in errors.items())
            + (f"; repeats that failed: {failed}" if failed else ""),
        ]
    return lines


def headline_peers(results: Results) -> str:
    doc, summary = results["peers"], results.typed("peers", Report).summary

    def measured(name: str) -> bool:
        found = summary.get(name)
        return bool(found and found.repeats)

    def share(name: str, bold: bool = False) -> str:
        if not measured(name):
            return "not measured"
        return Figure.summary(summary[name].ratio).text(percent(), bold)

    def p99(name: str) -> str:
        return f"{summary[name].p99_ms.median / 1000:.1f} s" if measured(name) else "-"

    unsorted = (
        ", as much as the model alone on unsorted batches "
        f"({percent()(summary['raw-arrival'].ratio.median)})"
        if measured("raw-arrival")
        else ""
    )
    return (
        f"- **Peers, side by side.** The same {doc['settings']['clients']} closed-loop clients,"
        " corpus and all-MiniLM-L6-v2 on 2 shared CPU cores: Ferry serves "
        f"{share('ferry-longpoll', True)} of the model's raw ceiling with submit + long-poll and "
        f"{share('ferry-wait', True)} in one round trip (p99 {p99('ferry-longpoll')} and "
        f"{p99('ferry-wait')}); a Celery task per request {share('celery')} (p99 "
        f"{p99('celery')}); Ray Serve's `@serve.batch` {share('ray')} (p99 {p99('ray')})"
        f"{unsorted}."
    )


if __name__ == "__main__":
    raise SystemExit(main())
