"""ferry_model_desired_workers follows the load: the API in uvicorn, a real sim worker, a
real Redis, jobs submitted over HTTP at one rate and then at twice it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.config.settings import Settings
from harness import webclient
from harness.served import served
from tests.integration.conftest import RunningLoop, build_sim_loop

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")

PHASE_S = 8.0


def scrape(base: str) -> dict[str, float]:
    """The sim model's scaling gauges from the API's /metrics."""
    text = webclient.get(f"{base}/metrics", timeout=10).text
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("ferry_model_"):
            for sample in family.samples:
                if sample.labels.get("model") == "sim":
                    found[sample.name] = sample.value
    return found


def submit_at(base: str, token: str, rate: float, seconds: float) -> int:
    """POST sim jobs at ``rate`` per second for ``seconds``, each sent at its time from a
    pool of 32, so a slow answer (a loaded machine: the API shares this process) does not
    slow the pace until answers take 32 / rate seconds (with four, half a second at 8 jobs/s
    was enough to halve the rate the gauges saw); returns how many."""
    count = round(rate * seconds)
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    with (
        webclient.client(base_url=base, headers=headers, limits=limits, timeout=30) as client,
        ThreadPoolExecutor(32) as pool,
    ):

        def post() -> None:
            answer = client.post("/v1/jobs", json={"model": "sim", "input": {"cost": 1}})
            assert answer.status_code == 202, answer.text

        start = time.monotonic()
        sent = []
        for n in range(count):
            time.sleep(max(0.0, start + n / rate - time.monotonic()))
            sent.append(pool.submit(post))
        for future in sent:
            future.result()
    return count


def test_the_desired_workers_follow_a_doubling_load(settings: Settings, token: str) -> None:
    # One worker finishes two jobs every 100 ms (20 jobs/s); the target utilisation 0.7
    # makes 8 jobs/s one worker's work and 16 jobs/s two workers'.
    slow = settings.model_copy(
        update={
            "batch_max_size": 2,
            "model_parameters": {
                **settings.model_parameters,
                "sim": {"latency_base_ms": 50.0, "latency_per_cost_ms": 25.0},
            },
            "autoscale_window_s": 4.0,
            "autoscale_target_utilisation": 0.7,
        }
    )
    readings: list[tuple[float, dict[str, float]]] = []
    stop = threading.Event()
    with served(slow) as api, RunningLoop(build_sim_loop(slow, "autoscale-test")):

        def scraper() -> None:  # as Prometheus would, every second
            while not stop.is_set():
                readings.append((time.monotonic(), scrape(api.base)))
                stop.wait(1.0)

        watcher = threading.Thread(target=scraper, daemon=True)
        watcher.start()
        try:
            submit_at(api.base, token, 3.0, 3.0)  # the worker learns its latency
            submit_at(api.base, token, 8.0, PHASE_S)
            low = scrape(api.base)
            submit_at(api.base, token, 16.0, PHASE_S)
            high = scrape(api.base)
        finally:
            stop.set()
            watcher.join(timeout=15)
    assert low["ferry_model_workers"] == high["ferry_model_workers"] == 1
    capacity = high["ferry_model_worker_throughput"]
    assert 12.0 < capacity < 30.0  # learned from its batches: about 20 jobs/s
    assert 5.5 < low["ferry_model_arrival_rate"] < 10.5
    ratio = high["ferry_model_arrival_rate"] / low["ferry_model_arrival_rate"]
    assert 1.5 < ratio < 2.6
    assert low["ferry_model_desired_workers"] == 1
    assert high["ferry_model_desired_workers"] >= 2
    # It rose while the load was high and never fell (the cool-down holds it).
    desired = [r["ferry_model_desired_workers"] for _, r in readings if r]
    risen = next(n for n, value in enumerate(desired) if value >= 2)
    assert all(value >= 2 for value in desired[risen:])
