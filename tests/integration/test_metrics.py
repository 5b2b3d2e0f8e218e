"""Prometheus metrics after a known workload (parsed with prometheus_client's own parser), and
the request id that follows a job through the logs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.ops.logs import JsonFormatter
from tests.integration.conftest import RunningLoop

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def process_metrics() -> Samples:
    """What this process exports: the in-process worker loop shares the registry."""
    return parse(generate_latest(REGISTRY).decode())


def test_counts_and_histograms_follow_a_known_workload(
    client: TestClient, auth: dict[str, str], sim_worker: Callable[..., RunningLoop]
) -> None:
    before = process_metrics()

    def submit(body: dict[str, Any]) -> str:
        response = client.post("/v1/jobs", json={"model": "sim", **body}, headers=auth)
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    ids = [submit({"input": {"cost": 2}}) for _ in range(4)]
    ids.append(submit({"input": {"cost": 1, "fail": True}, "priority": "vip"}))
    cancelled = submit({"input": {"cost": 1}})
    assert client.delete(f"/v1/jobs/{cancelled}", headers=auth).status_code == 200
    with sim_worker():
        for job_id in ids:
            client.get(f"/v1/jobs/{job_id}?wait=10", headers=auth)

    scraped = client.get("/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    api = parse(scraped.text)
    after = process_metrics()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("ferry_jobs_accepted_total", model="sim", lane="normal") == 5
    assert delta("ferry_jobs_accepted_total", model="sim", lane="vip") == 1
    assert delta("ferry_jobs_finished_total", model="sim", lane="normal", status="cancelled") == 1
    assert delta("ferry_jobs_finished_total", model="sim", lane="normal", status="succeeded") == 4
    assert delta("ferry_jobs_finished_total", model="sim", lane="vip", status="failed") == 1
    assert delta("ferry_job_latency_seconds_count", model="sim", lane="normal") == 4
    assert delta("ferry_job_queue_wait_seconds_count", model="sim", lane="vip") == 1
    # Every job ran in some batch: the batch sizes add up to the jobs run.
    assert delta("ferry_batch_size_sum", model="sim") == 5
    assert delta("ferry_batch_cost_sum", model="sim") == 4 * 2 + 1
    batches = delta("ferry_batch_size_count", model="sim")
    assert batches >= 1
    assert delta("ferry_batch_latency_seconds_count", model="sim") == batches
    assert delta("ferry_batch_predicted_latency_seconds_count", model="sim") == batches
    assert value(after, "ferry_batch_window_seconds", model="sim") >= 0
    assert value(after, "ferry_worker_memory_bytes", model="sim", kind="in_use") > 0
    assert value(after, "ferry_worker_memory_bytes", model="sim", kind="peak") > 0
    assert delta("ferry_http_requests_total", method="POST", route="/v1/jobs", status="202") == 6
    # Read from Redis at scrape time, on the API's /metrics: the queues are empty now.
    for lane in ("urgent", "vip", "normal", "bulk"):
        assert ("ferry_queue_depth", (("lane", lane), ("model", "sim"))) in api
        assert value(api, "ferry_queue_depth", model="sim", lane=lane) == 0
        assert value(api, "ferry_queue_lag", model="sim", lane=lane) == 0
        assert value(api, "ferry_queue_pending_entries", model="sim", lane=lane) == 0


def test_queue_gauges_show_a_backlog(client: TestClient, auth: dict[str, str]) -> None:
    for _ in range(3):
        client.post("/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=auth)
    api = parse(client.get("/metrics").text)
    assert value(api, "ferry_queue_depth", model="sim", lane="normal") == 3
    assert value(api, "ferry_queue_lag", model="sim", lane="normal") == 3


def test_a_request_id_follows_its_job_from_the_api_into_the_worker_log(
    client: TestClient,
    auth: dict[str, str],
    sim_worker: Callable[..., RunningLoop],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    response = client.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 1}},
        headers={**auth, "X-Request-ID": "trace-7f3a"},
    )
    assert response.headers["X-Request-ID"] == "trace-7f3a"
    job_id = response.json()["id"]
    with sim_worker():
        assert client.get(f"/v1/jobs/{job_id}?wait=10", headers=auth).json()["status"] == (
            "succeeded"
        )
    lines = [r for r in caplog.records if getattr(r, "request_id", None) == "trace-7f3a"]
    by_message = {r.getMessage(): r for r in lines}
    accepted, finished = by_message["job accepted"], by_message["job finished"]
    assert accepted.name.startswith("api.") and finished.name.startswith("workers.")
    assert vars(accepted)["job_id"] == vars(finished)["job_id"] == job_id
    assert vars(finished)["batch_id"]
    assert vars(finished)["status"] == "succeeded"
    # Neither the input nor the output ({"cost": ...}) is in the log lines.
    formatter = JsonFormatter()
    assert all('"cost"' not in formatter.format(record) for record in lines)
