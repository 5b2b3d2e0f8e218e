"""A model's queue is bounded in jobs and in bytes of input: past a bound a submission is a 503
queue_full naming it, with a Retry-After from the workers' learned rate; what was accepted runs,
and once a worker has drained the queue submissions are accepted again by themselves."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.jobs.submissions import QueueView, input_size
from core.config.settings import Settings
from core.models.estimates import ModelEstimate
from core.streams.bounds import UNKNOWN_RATE_RETRY_AFTER_S, retry_after_s
from core.streams.protocol import queued_bytes_key
from core.streams.queues import live_workers, model_stats, tenant_depths
from tests.integration.conftest import RunningLoop, build_sim_loop

BATCH_S = 1.5  # the sim's batch: slow enough that its drain time is seconds


def _bounded(settings: Settings, **bounds: int) -> Settings:
    return settings.model_copy(
        update={
            "queue_max_jobs": 0,
            "queue_max_bytes": 0,
            **bounds,
            "model_parameters": {
                **settings.model_parameters,
                "sim": {"latency_base_ms": BATCH_S * 1000, "latency_per_cost_ms": 0},
            },
        }
    )


@pytest.fixture
def api(request: pytest.FixtureRequest, settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(_bounded(settings, **request.param))) as test_client:
        yield test_client


def _submit(api: TestClient, auth: dict[str, str], **body: Any) -> Any:
    return api.post("/v1/jobs", json={"model": "sim", **body}, headers=auth)


def _finish(api: TestClient, auth: dict[str, str], ids: list[str]) -> list[str]:
    statuses = []
    for job_id in ids:
        deadline = time.monotonic() + 60
        while (job := api.get(f"/v1/jobs/{job_id}?wait=5", headers=auth).json())["status"] in (
            "queued", "running",
        ):  # fmt: skip
            assert time.monotonic() < deadline, job
        statuses.append(job["status"])
    return statuses


def _until_accepted(api: TestClient, auth: dict[str, str], **body: Any) -> Any:
    """Submit as a client told Retry-After would, until accepted (60 s at most)."""
    deadline = time.monotonic() + 60
    while (response := _submit(api, auth, **body)).status_code == 503:
        assert time.monotonic() < deadline, response.text
        time.sleep(min(float(response.headers["Retry-After"]), 1.0))
    return response


@pytest.mark.parametrize("api", [{"queue_max_jobs": 5}], indirect=True)
def test_past_the_job_bound_a_503_with_the_drain_time_then_accepted_again(
    api: TestClient,
    settings: Settings,
    auth: dict[str, str],
    redis_client: redis.Redis,
) -> None:
    configured = _bounded(settings, queue_max_jobs=5)
    prefix = settings.key_prefix
    # A worker runs a job, so the model's rate is learned, and stops.
    with RunningLoop(build_sim_loop(configured)):
        warm = _submit(api, auth, input={"cost": 1})
        assert _finish(api, auth, [warm.json()["id"]]) == ["succeeded"]
    estimate = ModelEstimate.from_hash(model_stats(redis_client, prefix, "sim"))
    assert estimate is not None

    # No worker: five jobs fill the queue, the sixth is refused.
    accepted = [_submit(api, auth, input={"cost": 1}, idempotency_key=f"k{i}") for i in range(5)]
    assert [r.status_code for r in accepted] == [202] * 5
    refused = _submit(api, auth, input={"cost": 1})
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["type"] == "queue_full"
    assert (error["bound"], error["limit"]) == ("FERRY_QUEUE_MAX_JOBS", 5)
    assert "FERRY_QUEUE_MAX_JOBS" in error["message"] and "sim" in error["message"]
    # Retry-After: the time the learned rate takes to finish one of the five, not a constant.
    view = QueueView(
        estimate,
        tenant_depths(redis_client, prefix, "sim"),
        live_workers(redis_client, prefix, "sim"),
    )
    expected = retry_after_s(view.drain_s(1))
    assert refused.headers["Retry-After"] == str(expected)
    assert 1 < expected < UNKNOWN_RATE_RETRY_AFTER_S  # a 1.5 s batch, and its window
    # Nothing was stored for it; a replay of an accepted job is still answered.
    listed = api.get("/v1/jobs?status=queued", headers=auth).json()["data"]
    assert len(listed) == 5
    replay = _submit(api, auth, input={"cost": 1}, idempotency_key="k0")
    assert replay.status_code == 202 and replay.headers["Idempotent-Replayed"] == "true"

    # A worker drains the queue: every accepted job runs, and new ones are taken again.
    with RunningLoop(build_sim_loop(configured)):
        again = _until_accepted(api, auth, input={"cost": 1})
        assert again.status_code == 202, again.text
        ids = [r.json()["id"] for r in accepted] + [again.json()["id"]]
        assert _finish(api, auth, ids) == ["succeeded"] * 6


TAG = "x" * 16  # {"cost":1,"tag":"xxx..."}: 35 bytes
BIG = {"cost": 1, "tag": TAG}
SMALL = {"cost": 1}


@pytest.mark.parametrize("api", [{"queue_max_bytes": 80}], indirect=True)
def test_past_the_byte_bound_a_503_while_a_smaller_input_fits(
    api: TestClient,
    settings: Settings,
    auth: dict[str, str],
    redis_client: redis.Redis,
) -> None:
    prefix = settings.key_prefix
    assert (input_size(BIG), input_size(SMALL)) == (35, 10)
    accepted = [_submit(api, auth, input=BIG) for _ in range(2)]  # 70 bytes
    assert [r.status_code for r in accepted] == [202] * 2
    assert int(redis_client.get(queued_bytes_key(prefix, "sim")) or 0) == 70

    refused = _submit(api, auth, input=BIG)  # 105 > 80
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["bound"], error["limit"]) == (
        "queue_full", "FERRY_QUEUE_MAX_BYTES", 80,
    )  # fmt: skip
    # No worker has ever published a rate for this model: the fallback.
    assert refused.headers["Retry-After"] == str(UNKNOWN_RATE_RETRY_AFTER_S)
    small = _submit(api, auth, input=SMALL)  # 80 fits
    assert small.status_code == 202, small.text
    accepted.append(small)

    # An input larger than the whole bound (83 bytes) could never fit: refused at once.
    huge = _submit(api, auth, input={"cost": 1, "tag": "y" * 64}, priority="bulk")
    assert (huge.status_code, huge.json()["error"]["type"]) == (413, "payload_too_large")
    assert "FERRY_QUEUE_MAX_BYTES" in huge.json()["error"]["message"]

    with RunningLoop(build_sim_loop(_bounded(settings, queue_max_bytes=80))):
        again = _until_accepted(api, auth, input=BIG)
        assert again.status_code == 202, again.text
        ids = [r.json()["id"] for r in [*accepted, again]]
        assert _finish(api, auth, ids) == ["succeeded"] * 4
    # Every acknowledged entry took its bytes off the count.
    assert int(redis_client.get(queued_bytes_key(prefix, "sim")) or 0) == 0
