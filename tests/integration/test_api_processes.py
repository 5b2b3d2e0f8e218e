"""FERRY_API_PROCESSES: `ferry api` runs several processes on one port, sums their
metrics, and stops them all cleanly."""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import webclient
from harness.ports import free_port
from tests.integration.api_process import key_token, ready, start_api

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


def _children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in found]


def test_two_api_processes_share_the_port_and_their_metrics_and_stop_cleanly(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> None:
    token = key_token(database_url, "processes")
    port = free_port()
    process = start_api(
        redis_url,
        database_url,
        key_prefix,
        tmp_path,
        port,
        FERRY_API_PROCESSES="2",
        FERRY_API_SHUTDOWN_DELAY_S="0.5",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        until = time.monotonic() + 90
        while len(_children(process.pid)) < 2 or not ready(base):
            assert process.poll() is None and time.monotonic() < until, "the API did not start"
            time.sleep(0.2)
        servers = _children(process.pid)
        assert len(servers) == 2

        def submit(_: int) -> int:
            # A connection of its own each: the kernel spreads them over both processes.
            with webclient.client(base_url=base, timeout=30) as client:
                return client.post(
                    "/v1/jobs",
                    json={"model": "sim", "input": {"cost": 1}},
                    headers={"Authorization": f"Bearer {token}"},
                ).status_code

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(submit, range(40))) == [202] * 40
        # Whichever process answers /metrics, it counts every process's jobs.
        for _ in range(4):
            metrics = webclient.get(f"{base}/metrics", timeout=10).text
            counted = re.search(
                r'ferry_jobs_accepted_total\{lane="normal",model="sim"\} (\S+)', metrics
            )
            assert counted is not None and float(counted.group(1)) == 40.0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in servers)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
