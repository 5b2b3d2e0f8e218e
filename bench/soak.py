"""A soak: mixed load for a long while, the sim worker killed now and then, memory watched.

Starts ``ferry up`` (its own Redis, SQLite, the sim model), submits sim jobs
at a steady rate across the lanes, kills the sim worker with SIGKILL every
``--kill-every`` seconds (``ferry up`` restarts it; its unacknowledged entries
are run again), samples the resident memory of every Ferry process, and at
the end checks that every accepted job reached exactly one terminal state.
The workers' execution record (``FERRY_EXECUTION_LOG_DIR``, appended before
each result write) counts what was computed: a job computed again is allowed
only where a killed worker had computed it and not yet written it.

    python -m bench.soak [--minutes 30] [--rate 40] [--kill-every 60]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sqlite3
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis

from bench import results
from harness.accounting import count_executions
from harness.stack import FerryUp
from workers.gpu.executions import read_executions

LANES = (("urgent", 0.05), ("vip", 0.15), ("normal", 0.7), ("bulk", 0.1))


class Soak:
    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.args = args
        self.stack = FerryUp(
            root,
            celery=False,
            FERRY_MODELS="sim",
            FERRY_SIM_LATENCY_BASE_MS="20",
            FERRY_SIM_LATENCY_PER_COST_MS="0.2",
            FERRY_VISIBILITY_TIMEOUT_S="10",
            FERRY_EXECUTION_LOG_DIR=str(root / "executions"),
        )
        self.root = root
        self.accepted: list[str] = []
        self.refused = collections.Counter[int]()
        self.done = collections.Counter[str]()
        self.killed: set[int] = set()  # the workers' pids, for the execution record
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self._listen_until = 0.0

    def start(self) -> None:
        self.stack.start()
        self.token = self.stack.token
        self.redis_url = self.stack.env["FERRY_REDIS_URL"]

    def listen(self) -> None:
        """Count terminal transitions as the workers announce them."""
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe("ferry:done")
        while not self.stop.is_set() or time.monotonic() < self._listen_until:
            message = pubsub.get_message(timeout=0.5)
            if message and isinstance(message.get("data"), str):
                self.done.update(message["data"].split(","))

    def submit(self, until: float) -> None:
        rng = random.Random(7)
        headers = {"Authorization": f"Bearer {self.token}"}
        interval = 1.0 / self.args.rate
        next_at = time.monotonic()
        with httpx.Client(base_url=self.stack.base, headers=headers, timeout=10) as client:
            while time.monotonic() < until:
                lane = rng.choices([name for name, _ in LANES], [w for _, w in LANES])[0]
                body = {
                    "model": "sim",
                    "input": {"cost": rng.randint(1, 64)},
                    "priority": lane,
                    "idempotency_key": str(uuid.uuid4()),
                }
                self._post(client, body)
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))

    def _post(self, client: httpx.Client, body: dict[str, Any]) -> None:
        for _ in range(20):  # the same idempotency key: a retry never doubles a job
            try:
                response = client.post("/v1/jobs", json=body)
            except httpx.HTTPError:
                time.sleep(0.5)
                continue
            if response.status_code == 202:
                self.accepted.append(response.json()["id"])
                return
            self.refused[response.status_code] += 1
            if response.status_code != 503:
                return
            time.sleep(0.5)

    def kill_worker(self) -> None:
        for pid in self.stack.children():
            if b"worker\x00--model\x00sim" in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
                self.killed.add(pid)

    def sample(self, started: float) -> None:
        rss: dict[str, float] = {}
        for pid in self.stack.children():
            name = _name(_cmdline(pid))
            rss[name] = rss.get(name, 0.0) + _rss_mib(pid)
        self.samples.append(
            {"t_s": round(time.monotonic() - started), "rss_mib": rss,
             "accepted": len(self.accepted), "terminal_events": sum(self.done.values())}
        )  # fmt: skip

    def finish(self, timeout_s: float) -> dict[str, Any]:
        db = self.root / "ferry.db"
        until = time.monotonic() + timeout_s
        while True:
            statuses = _statuses(db, self.accepted)
            open_jobs = sum(1 for s in statuses.values() if s in ("queued", "running"))
            if open_jobs == 0 or time.monotonic() > until:
                break
            time.sleep(1.0)
        self._listen_until = time.monotonic() + 3
        time.sleep(3)
        missing = [job for job in self.accepted if job not in statuses]
        counts = collections.Counter(statuses.values())
        executions = count_executions(read_executions(self.root / "executions"), self.killed)
        return {
            "accepted": len(self.accepted),
            "refused": dict(self.refused),
            "statuses": dict(counts),
            "lost": len(missing) + open_jobs,
            "executions": sum(executions.per_job[job] for job in self.accepted),
            "after_crash": sum(executions.after_crash[job] for job in self.accepted),
            "run_twice": sum(executions.run_twice[job] for job in self.accepted),
            "written_twice": sum(1 for job in self.accepted if self.done[job] > 1),
            "worker_kills": len(self.killed),
        }

    def close(self) -> None:
        self.stop.set()
        self.stack.stop(self.stack.process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=40.0, help="jobs per second")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ferry-soak-") as tmp:
        soak = Soak(Path(tmp), args)
        try:
            soak.start()
            threading.Thread(target=soak.listen, daemon=True).start()
            started = time.monotonic()
            until = started + args.minutes * 60
            submitter = threading.Thread(target=soak.submit, args=(until,), daemon=True)
            submitter.start()
            next_kill = started + args.kill_every
            next_sample = started
            while time.monotonic() < until:
                now = time.monotonic()
                if now >= next_sample:
                    soak.sample(started)
                    print(json.dumps(soak.samples[-1]), flush=True)
                    next_sample += args.sample_every
                if now >= next_kill:
                    soak.kill_worker()
                    next_kill += args.kill_every
                time.sleep(0.2)
            submitter.join()
            result = soak.finish(timeout_s=120)
            soak.sample(started)
        finally:
            soak.close()
    settings = {
        "minutes": args.minutes,
        "rate_per_s": args.rate,
        "kill_every_s": args.kill_every,
        "sample_every_s": args.sample_every,
    }
    report = {**result, "memory": soak.samples}
    results.write(args.out, report, settings=settings, head=results.provenance("soak", argv))
    print(json.dumps({k: v for k, v in report.items() if k != "memory"}, indent=2))
    first, last = soak.samples[1] if len(soak.samples) > 1 else soak.samples[0], soak.samples[-1]
    for name in sorted(last["rss_mib"]):
        before, after = first["rss_mib"].get(name, 0.0), last["rss_mib"][name]
        print(f"  {name:<14} RSS {before:7.1f} -> {after:7.1f} MiB")
    print(f"wrote {args.out}")
    clean = result["lost"] == result["run_twice"] == result["written_twice"] == 0
    return 0 if clean else 1


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _name(cmdline: bytes) -> str:
    parts = [p.decode(errors="replace") for p in cmdline.split(b"\x00") if p]
    if "ferry" in parts:
        rest = parts[parts.index("ferry") + 1 :]
        return "-".join(p for p in rest if not p.startswith("--"))[:14] or "ferry"
    return Path(parts[0].split()[0]).name if parts else "?"  # redis-server retitles itself


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _statuses(db: Path, ids: list[str]) -> dict[str, str]:
    conn = sqlite3.connect(db, timeout=30)
    try:
        rows = conn.execute(
            "SELECT id, status FROM jobs WHERE id IN (SELECT value FROM json_each(?))",
            (json.dumps(ids),),
        ).fetchall()
    finally:
        conn.close()
    return {row[0]: row[1] for row in rows}


if __name__ == "__main__":
    raise SystemExit(main())
