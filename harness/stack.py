"""`ferry up` as tests and benchmarks run it: a fresh stack in a directory of its own."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import webclient
from harness.ports import free_port
from harness.processes import process_table

# Set to 1 by `python -m bench all --smoke` for the benchmarks it starts.
SMOKE_ENV = "FERRY_BENCH_SMOKE"
# What a smoke run sets besides, in its benchmarks' processes and in their stacks: minilm
# reads at most 64 tokens a text (its own limit is 256), so a worker's start-up calibration
# (a batch of 16 texts that long) and every batch take a fraction of the CPU.
SMOKE_SETTINGS = {"FERRY_MINILM_MAX_TOKENS": "64"}


class FerryUp:
    """Starts ``ferry up`` with ``settings`` (FERRY_* variables) and reads its banner.

    ``celery``: whether the stack needs Celery's worker and beat (webhooks, backfills, the
    reconciler). A benchmark's smoke stack that says it does not starts without them;
    every other stack starts them.
    """

    def __init__(self, root: Path, *, celery: bool = True, **settings: str) -> None:
        self.root = root
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        smoke = os.environ.get(SMOKE_ENV) == "1"
        self.env.update(
            FERRY_DATA_DIR=str(root),
            FERRY_API_PORT=str(self.port),
            # Each stack's workers serve /metrics from a port of their own.
            FERRY_METRICS_PORT_BASE=str(free_port()),
            # A benchmark's smoke run proves its own code runs, which never looks at Flower.
            FERRY_FLOWER_PORT="0" if smoke else str(free_port()),
            FERRY_LOG_LEVEL=os.environ.get("FERRY_LOG_LEVEL", "WARNING"),
            # No load balancer is in front of these stacks to notice /readyz go 503:
            # stopping skips the wait for one (a test of the wait sets its own).
            FERRY_API_SHUTDOWN_DELAY_S="0",
            PYTHONUNBUFFERED="1",
        )
        if smoke:
            # Nor at the Celery events the workers send for Flower.
            self.env["FERRY_WORKER_EVENTS"] = "false"
            self.env.update(SMOKE_SETTINGS)
            if not celery:
                self.env["FERRY_UP_CELERY"] = "0"
        self.env.update(settings)
        self.output: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self.token = ""

    def start(self, timeout_s: float = 120.0) -> None:
        self.process = self.spawn([sys.executable, "-m", "ferry", "up"])
        until = time.monotonic() + timeout_s
        while not any("Ferry is up." in line for line in self.output):
            if self.process.poll() is not None or time.monotonic() > until:
                raise RuntimeError("ferry up failed:\n" + "".join(self.output)[-3000:])
            time.sleep(0.2)
        text = "".join(self.output)
        self.token = _after(text, "API key")
        # What a process started beside the stack needs to join it.
        self.env["FERRY_REDIS_URL"] = _after(text, "Redis")
        self.env["FERRY_DATABASE_URL"] = _after(text, "Database")

    @contextlib.contextmanager
    def running(self, timeout_s: float = 120.0) -> Iterator[None]:
        """The stack up (:meth:`start`) for the block, stopped after it however it ends."""
        try:
            self.start(timeout_s)
            yield
        finally:
            self.stop(self.process)

    def spawn(self, args: list[str]) -> subprocess.Popen[str]:
        """A process with the stack's settings, its output collected with the stack's."""
        process = subprocess.Popen(
            args,
            cwd=self.root,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, args=(process,), daemon=True).start()
        return process

    def children(self) -> list[int]:
        """The pids of the processes ``ferry up`` started."""
        assert self.process is not None
        return [pid for pid, parent, _ in process_table() if parent == self.process.pid]

    @staticmethod
    def stop(process: subprocess.Popen[str] | None, timeout_s: float = 90.0) -> None:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.output.append(line)


def compute_seconds(port: int, model: str) -> float:
    """A worker's device time so far (``ferry_worker_compute_seconds_total`` on its port)."""

    text = webclient.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    pattern = rf'^ferry_worker_compute_seconds_total\{{model="{re.escape(model)}"\}} (\S+)$'
    match = re.search(pattern, text, re.M)
    if match is None:
        raise RuntimeError("the worker exported no ferry_worker_compute_seconds_total")
    return float(match.group(1))


def batch_figures(port: int, model: str) -> dict[str, Any]:
    """A worker's batches so far, from its /metrics: how many, their mean size, and the
    mean seconds a batch spent in each stage (prepare, compute, record, acknowledge)."""

    return batch_figures_of(
        webclient.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, model
    )


def batch_figures_of(text: str, model: str) -> dict[str, Any]:
    """:func:`batch_figures` from the text of a /metrics answer."""
    from prometheus_client.parser import text_string_to_metric_families

    size_sum = batches = 0.0
    stages: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name == "ferry_batch_size_sum":
                size_sum = sample.value
            elif sample.name == "ferry_batch_size_count":
                batches = sample.value
            elif sample.name == "ferry_batch_stage_seconds_sum":
                stages[sample.labels["stage"]] = sample.value
    return {
        "batches": int(batches),
        "mean_batch": round(size_sum / batches, 1) if batches else 0.0,
        "stage_ms_per_batch": {
            stage: round(1000.0 * total / batches, 2) if batches else 0.0
            for stage, total in sorted(stages.items())
        },
    }


def _after(text: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}\s+(\S+)", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no {label!r} line in the ferry up banner")
    return match.group(1)
