"""Every benchmark the documents cite, in one command.

    python -m bench all            # the full set: writes bench/results/, then renders the docs
    python -m bench all --smoke    # each for seconds, into a temporary folder: proves they run
    python -m bench list           # the benchmarks, their commands and what they need

Each benchmark runs as its own process (``python -m bench.NAME ...``), one
after the other for the full set (they measure the machine; two at once
would measure each other); a smoke run may run ``--parallel`` of them at
once, the longest first, since its figures mean nothing, and starts each one
from a fork of this process, which imported what they all import (torch,
transformers, the HTTP and database clients: ``PRELOAD``) once. The
benchmarks of a run that read the corpus (bench/corpus.py) share one reading
of it. Each one's seconds and CPU seconds (its own and its stacks') are
printed as it ends. A benchmark whose tool, device or package is missing
(wrk, a CUDA device, the bench extra's Ray) is skipped and said so; the exit
status is 1 if any benchmark failed, or was skipped where ``--strict`` asks
for all of them.

After a full run of every benchmark, the documents are rendered from the new
files (``python -m bench.render``) and, if every file cites the same commit
with no uncommitted change, ``bench/results/MANIFEST.json`` says so: from then
on a unit test fails when a document cites a file of another commit.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from bench.corpus import CACHE_ENV
from bench.results import MAKE_ENV, RESULTS, SMOKE_ENV
from harness.stack import SMOKE_SETTINGS

ROOT = RESULTS.parent.parent


@dataclass(frozen=True)
class Bench:
    name: str  # the results file's stem
    module: str
    full: tuple[str, ...]  # the published run's arguments
    smoke: tuple[str, ...]  # seconds, once
    minutes: float  # the full run, about, on 2 cores
    needs: tuple[str, ...] = ()  # "wrk", "cuda", "ray"
    # The smoke run, about, alone on 2 cores: a parallel smoke starts the longest first,
    # so that none of them starts last and runs on after the others are done.
    smoke_s: float = 10.0


BENCHES = (
    Bench("scheduler", "bench.simulate", (), ("--smoke", "--repeats", "1"), 5, smoke_s=4),
    Bench(
        "e2e",
        "bench.e2e",
        (),
        (
            "--jobs",
            "8",
            "--concurrency",
            "4",
            "--rounds",
            "1",
            "--raw-sizes",
            "1,8",
            "--modes",
            "none,ferry",
            "--one-stack",
        ),
        10,
        smoke_s=24,
    ),
    Bench(
        "api",
        "bench.api",
        (),
        (
            "--duration",
            "1",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--connections",
            "4",
            "--databases",
            "sqlite",
            "--api-processes",
            "1",
        ),
        7,
        ("wrk",),
        smoke_s=14,
    ),
    Bench(
        "clients",
        "bench.clients",
        (),
        (
            "--duration",
            "1",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--clients",
            "4",
            "--threads",
            "1",
            "--texts",
            "32",
            "--raw-sizes",
            "16",
        ),
        8,
        ("wrk",),
        smoke_s=18,
    ),
    Bench(
        "peers",
        "bench.peers",
        (),
        (
            "--duration",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--clients",
            "4",
            "--texts",
            "64",
            "--raw-threads",
            "1",
            "--raw-sizes",
            "16",
        ),
        12,
        ("ray",),
        smoke_s=30,
    ),
    Bench(
        "backfill",
        "bench.backfill",
        (),
        ("--window", "2", "--alone", "1", "--lines", "2000", "--repeats", "1"),
        4,
        smoke_s=18,
    ),
    Bench(
        "fairness",
        "bench.fairness",
        (),
        ("--seconds", "1", "--flood", "20", "--repeats", "1"),
        15,
        smoke_s=13,
    ),
    Bench(
        "pipeline",
        "bench.pipeline",
        ("--postgres",),
        ("--jobs", "64", "--rounds", "1", "--modes", "plain,three-stage", "--one-stack"),
        18,
        smoke_s=8,
    ),
    Bench(
        "recording",
        "bench.recording",
        ("--postgres",),
        ("--size", "16", "--batches", "2"),
        1,
        smoke_s=1,
    ),
    # torch.compile's compile alone takes longer than the whole smoke should: left out there.
    Bench(
        "backends",
        "bench.backends",
        (),
        (
            "--quick",
            "--repeats",
            "1",
            "--texts",
            "16",
            "--arrival-texts",
            "16",
            "--backends",
            "onnx",
        ),
        4,
        smoke_s=12,
    ),
    Bench(
        "soak",
        "bench.soak",
        ("--minutes", "60"),
        (
            "--minutes",
            "0.1",
            "--rate",
            "20",
            "--kill-worker-every",
            "2",
            "--kill-api-every",
            "3",
            "--kill-redis-every",
            "4",
            "--sample-every",
            "1",
        ),
        63,
        smoke_s=20,
    ),
    Bench(
        "capacity",
        "bench.capacity",
        (),
        (
            "--jobs",
            "100",
            "--rounds",
            "1",
            "--clients",
            "4",
            "--enqueue-messages",
            "512",
            "--idle-s",
            "1",
            "--history",
            "2000",
        ),
        5,
        smoke_s=12,
    ),
    Bench(
        "sentinel",
        "bench.sentinel",
        (),
        ("--rounds", "1", "--load-s", "6", "--kill-at-s", "2", "--rate", "10"),
        2,
        smoke_s=16,
    ),
    Bench("cluster", "bench.cluster", (), ("--jobs", "300", "--rounds", "1"), 1, smoke_s=4),
    Bench("generation", "bench.generation", (), ("--smoke",), 10, smoke_s=5),
    Bench("generation_stack", "bench.generation_stack", (), ("--smoke",), 4, smoke_s=12),
    Bench("generation_promises", "bench.generation_promises", (), ("--smoke",), 6, smoke_s=10),
    Bench("generation_resume", "bench.generation_resume", (), ("--smoke",), 1, smoke_s=15),
    Bench(
        "oip",
        "bench.oip",
        (),
        ("--clients", "4", "--warmup", "0", "--duration", "1", "--rounds", "1"),
        2,
        smoke_s=15,
    ),
    Bench(
        "gpu",
        "bench.gpu",
        ("--jobs", "10000", "--seconds", "10"),
        ("--quick",),
        6,
        ("cuda",),
        smoke_s=60,
    ),
)


@dataclass
class Outcome:
    bench: Bench
    status: str  # "ok", "failed", "skipped"
    seconds: float = 0.0
    why: str = ""
    # CPU seconds of the benchmark's process and of the processes it reaped (its stacks,
    # its raw models): on two cores the smoke run is bound by their sum.
    cpu_s: float = 0.0


def missing(bench: Bench) -> str | None:
    """Why ``bench`` cannot run here, or None."""
    for need in bench.needs:
        if need == "wrk" and shutil.which("wrk") is None:
            return "wrk is not on the PATH (apt-get install -y wrk)"
        if need == "cuda" and not shutil.which("nvidia-smi"):
            return "no CUDA device (nvidia-smi is not on the PATH)"
        if need == "ray" and importlib.util.find_spec("ray") is None:
            return "ray is not installed (the bench extra: make bench-peers installs it)"
    return None


def command(bench: Bench, out: Path, smoke: bool) -> list[str]:
    args = bench.smoke if smoke else bench.full
    return [sys.executable, "-m", bench.module, *args, "--out", str(out / f"{bench.name}.json")]


# What a smoke run's benchmarks import before their own code: imported once in this
# process, which then forks each benchmark's (most of them load minilm or build a language
# model, and these imports are seconds of CPU each time: a fifth of the smoke run's).
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.bert.modeling_bert",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "tokenizers",
    "numpy",
    "httpx",
    "sqlalchemy",
    "redis",
    "pydantic",
    "core.config.settings",
    "backends.catalog",
    "harness.stack",
    "bench.corpus",
    "bench.report",
)


@dataclass
class Launched:
    bench: Bench
    pid: int
    log: Path
    started: float
    process: subprocess.Popen[bytes] | None = None  # None: forked


def environment(smoke: bool, corpus: Path) -> dict[str, str]:
    """A benchmark's environment: this one's, with the run's kind and shared corpus."""
    env = {**os.environ, SMOKE_ENV: "1" if smoke else "0", **(SMOKE_SETTINGS if smoke else {})}
    env[CACHE_ENV] = str(corpus)
    env.setdefault(MAKE_ENV, "make bench-smoke" if smoke else "make bench")
    return env


def preload() -> bool:
    """Import PRELOAD here; whether this process may now fork a benchmark's (it has one
    thread: a fork copies only the calling thread, so a lock another held would stay held)."""
    import threading

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    return threading.active_count() == 1


def launch(bench: Bench, out: Path, smoke: bool, corpus: Path, fork: bool) -> Launched:
    """``python -m <module> <args>``, run by a new interpreter or, ``fork``, by a fork of
    this one (with PRELOAD already imported): the module runs as ``__main__`` either way,
    through runpy, which is what ``python -m`` uses."""
    argv = command(bench, out, smoke)
    env = environment(smoke, corpus)
    log = out / f"{bench.name}.log"
    started = time.monotonic()
    if not fork:
        with log.open("w") as sink:
            process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT
            )
        return Launched(bench, process.pid, log, started, process)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_forked(bench.module, argv[3:], env, log)
    return Launched(bench, pid, log, started)


def _run_forked(module: str, args: list[str], env: dict[str, str], log: Path) -> NoReturn:
    """In the forked child: the benchmark's module as ``__main__``, its output to ``log``,
    then out with its exit status (never back into the parent's frames)."""
    code = 1
    try:
        sink = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(sink, 1)
        os.dup2(sink, 2)
        os.close(sink)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(ROOT)
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def finish(launched: Launched, status: int, usage: resource.struct_rusage) -> Outcome:
    """The outcome of a benchmark whose process ended with ``status``, having used ``usage``
    (its own CPU and that of the processes it reaped: its stacks, its raw models)."""
    code = os.waitstatus_to_exitcode(status)
    if launched.process is not None:
        launched.process.returncode = code  # reaped here, by wait4
    seconds = time.monotonic() - launched.started
    cpu_s = usage.ru_utime + usage.ru_stime
    if code != 0:
        tail = launched.log.read_text(errors="replace").splitlines()[-15:]
        why = f"exit {code}:\n  " + "\n  ".join(tail)
        return Outcome(launched.bench, "failed", seconds, why, cpu_s)
    return Outcome(launched.bench, "ok", seconds, cpu_s=cpu_s)


def report(outcome: Outcome) -> None:
    detail = f" ({outcome.why})" if outcome.why and outcome.status == "skipped" else ""
    print(
        f"{outcome.bench.name:10} {outcome.status:8} {outcome.seconds:6.0f} s "
        f"{outcome.cpu_s:6.0f} cpu-s{detail}",
        flush=True,
    )
    if outcome.status == "failed":
        print(f"  {outcome.why}", flush=True)


def run_all(chosen: list[Bench], out: Path, smoke: bool, parallel: int) -> list[Outcome]:
    """Each of ``chosen``, ``parallel`` at once, its outcome printed as it ends.

    This process waits for its benchmarks with ``wait4`` on its one thread, which gives
    each one's CPU apart from the others' (the sum of every reaped child's would mix the
    benchmarks that run at once).
    """
    out.mkdir(parents=True, exist_ok=True)
    if smoke and parallel > 1:
        chosen = sorted(chosen, key=lambda b: -b.smoke_s)
    # A smoke run's figures mean nothing, so its benchmarks may start from a fork of this
    # process; a full run's each start from a new interpreter, as a user's would.
    fork = smoke and hasattr(os, "fork") and preload()
    # The benchmarks that read the corpus share one reading of it (seconds of CPU each).
    corpus = tempfile.TemporaryDirectory(prefix="ferry-bench-corpus-")
    outcomes: list[Outcome] = []
    running: dict[int, Launched] = {}
    pending = list(chosen)
    with corpus:
        try:
            while pending or running:
                while pending and len(running) < max(1, parallel):
                    bench = pending.pop(0)
                    why = missing(bench)
                    if why:
                        outcomes.append(Outcome(bench, "skipped", why=why))
                        report(outcomes[-1])
                        continue
                    launched = launch(bench, out, smoke, Path(corpus.name), fork)
                    running[launched.pid] = launched
                if not running:
                    break
                pid, status, usage = os.wait4(-1, 0)
                if pid in running:
                    outcomes.append(finish(running.pop(pid), status, usage))
                    report(outcomes[-1])
        finally:
            # Interrupted (Ctrl-C, an error here): the benchmarks still running stop too,
            # each stopping its stacks as SIGTERM asks.
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            for pid in running:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
    return outcomes


def mark_same_commit(folder: Path) -> bool:
    """MANIFEST.json's same_commit, set when the cited files are one set at one commit
    (never cleared here: a later partial run is what the unit test is there to catch)."""
    from bench.render import same_commit_problems
    from bench.report import Results

    problems = same_commit_problems(ROOT, Results(folder))
    for problem in problems:
        print(f"not one set: {problem}")
    if problems:
        return False
    manifest = folder / "MANIFEST.json"
    state = json.loads(manifest.read_text()) if manifest.exists() else {}
    state["same_commit"] = True
    manifest.write_text(json.dumps(state, indent=2) + "\n")
    print(f"{manifest.relative_to(ROOT)}: same_commit is on")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("all", "list"))
    parser.add_argument("--smoke", action="store_true", help="each for seconds, once")
    parser.add_argument("--only", default="", help="comma-separated names")
    parser.add_argument("--skip", default="", help="comma-separated names")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the results folder (default bench/results; a new temporary folder with --smoke)",
    )
    parser.add_argument("--parallel", type=int, default=1, help="benchmarks at once (--smoke)")
    parser.add_argument(
        "--strict", action="store_true", help="a benchmark skipped for a missing need fails too"
    )
    args = parser.parse_args(argv)
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - {b.name for b in BENCHES}
    if unknown:
        parser.error(f"no benchmark named {', '.join(sorted(unknown))}")
    chosen = [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]
    if args.what == "list":
        for b in chosen:
            needs = f"  (needs {', '.join(b.needs)})" if b.needs else ""
            print(f"{b.name:10} ~{b.minutes:g} min  python -m {b.module} {' '.join(b.full)}{needs}")
            print(f"{'':10} smoke    python -m {b.module} {' '.join(b.smoke)}")
        return 0
    if args.smoke:
        out = args.out or Path(tempfile.mkdtemp(prefix="ferry-bench-smoke-"))
        if out.resolve() == RESULTS:
            parser.error("a smoke run never writes bench/results/ (its figures mean nothing)")
    else:
        out = args.out or RESULTS.relative_to(ROOT)
        if args.parallel > 1:
            parser.error("the full set runs one benchmark at a time (they measure the machine)")
        total = sum(b.minutes for b in chosen if not missing(b))
        print(f"about {total:.0f} minutes on 2 cores", flush=True)
    print(f"results in {out}", flush=True)
    started = time.monotonic()
    outcomes = run_all(chosen, out, args.smoke, args.parallel)
    cpu_s = sum(o.cpu_s for o in outcomes)
    print(f"{len(outcomes)} benchmarks in {time.monotonic() - started:.0f} s, {cpu_s:.0f} cpu-s")
    failed = [o for o in outcomes if o.status == "failed"]
    skipped = [o for o in outcomes if o.status == "skipped"]
    from bench import render
    from bench.report import Results

    if not args.smoke and not failed and (ROOT / out).resolve() == RESULTS:
        render.main([])
        if not only and not skip and not [o for o in skipped if o.bench.name != "gpu"]:
            mark_same_commit(RESULTS)
    if args.smoke and not failed:
        # The smoke files must still render: the renderers read what the scripts write.
        rendered = out / "rendered.md"
        rendered.write_text(render.render_all(Results(out, smoke=True)))
        print(f"rendered every table from them into {rendered}")
    return 1 if failed or (args.strict and skipped) else 0


if __name__ == "__main__":
    raise SystemExit(main())
