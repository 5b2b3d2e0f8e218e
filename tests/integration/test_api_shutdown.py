"""`ferry api` stops gracefully: not ready first, then requests in flight finish."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness import webclient
from harness.ports import free_port
from tests.integration.api_process import key_token, ready, start_api

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


@pytest.fixture
def api(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    token = key_token(database_url, "shutdown")
    port = free_port()
    process = start_api(
        redis_url, database_url, key_prefix, tmp_path, port, FERRY_API_SHUTDOWN_DELAY_S="1.5"
    )
    base = f"http://127.0.0.1:{port}"
    until = time.monotonic() + 60
    while not ready(base):
        assert process.poll() is None and time.monotonic() < until, "the API did not start"
        time.sleep(0.1)
    try:
        yield process, base, token
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_sigterm_turns_not_ready_then_finishes_long_polls_and_exits_0(
    api: tuple[subprocess.Popen[bytes], str, str],
) -> None:
    process, base, token = api
    headers = {"Authorization": f"Bearer {token}"}
    job = webclient.post(
        f"{base}/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=headers
    ).json()
    with ThreadPoolExecutor(1) as pool:
        # A long-poll in flight (no worker runs, so it would wait 20 s).
        polling = pool.submit(
            httpx.get, f"{base}/v1/jobs/{job['id']}?wait=20", headers=headers, timeout=30
        )
        time.sleep(0.5)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        ready = webclient.get(f"{base}/readyz", timeout=5)
        assert ready.status_code == 503
        assert ready.json()["checks"]["api"] == "shutting down"
        answered = polling.result(timeout=30)
    assert answered.status_code == 200  # returned early with the job as it is
    assert answered.json()["status"] == "queued"
    assert process.wait(timeout=30) == 0
    assert time.monotonic() - started < 15
