"""`ferry api` stops gracefully: not ready first, then requests in flight finish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from core.db.keys import create_key
from core.db.schema import make_engine, make_sessionmaker
from harness import webclient
from harness.ports import free_port

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


@pytest.fixture
def api(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    engine = make_engine(database_url)
    with make_sessionmaker(engine)() as session:
        token = create_key(session, "shutdown").token
    engine.dispose()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update(
        FERRY_REDIS_URL=redis_url, FERRY_DATABASE_URL=database_url, FERRY_KEY_PREFIX=key_prefix,
        FERRY_DATA_DIR=str(tmp_path), FERRY_API_SHUTDOWN_DELAY_S="1.5", FERRY_LOG_LEVEL="WARNING",
    )  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "ferry", "api", "--port", str(port)], env=env, cwd=tmp_path
    )
    base = f"http://127.0.0.1:{port}"
    until = time.monotonic() + 60
    while True:
        try:
            if webclient.get(f"{base}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
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
