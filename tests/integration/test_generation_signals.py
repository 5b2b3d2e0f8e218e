"""What a generation worker tells the rest of Ferry, on real parts: the API's wait estimate
and deadline refusal from its published step time, GET /v1/models, its metrics, Flower."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from core.config.settings import Settings
from core.models.generation_estimates import GenerationEstimate
from core.streams.queues import stats_text
from tests.integration.generation_worker import (
    MODEL,
    Worker,
    generation_settings,
    result,
    submit,
)
from tests.integration.test_presence import Watcher
from workers.gpu.control import ControlResponder
from workers.gpu.generation_main import generation_conf, generation_facts
from workers.gpu.presence import CeleryPresence, node_name

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


@pytest.fixture
def gen_settings(settings: Settings, tmp_path: Path) -> Settings:
    return generation_settings(settings, tmp_path, max_running=4)


def post(client: TestClient, auth: dict[str, str], **body: Any) -> Any:
    return client.post("/v1/jobs", json={"model": MODEL, **body}, headers=auth)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


def test_a_new_jobs_estimated_wait_follows_the_learned_step_time_and_a_short_deadline_is_refused(
    gen_client: TestClient,
    auth: dict[str, str],
    gen_worker: Callable[..., Worker],
    gen_settings: Settings,
) -> None:
    def job(i: int) -> dict[str, Any]:
        return {"prompt": f"job number {i} of the load", "max_tokens": 32, "temperature": 0}

    with gen_worker():
        # Some jobs run first: the worker learns its step time and the usual job.
        warm = [submit(gen_client, auth, **job(i)) for i in range(8)]
        for job_id in warm:
            assert result(gen_client, auth, job_id)["status"] == "succeeded"
        time.sleep(0.5)  # its figures published (every 250 ms), the API's view re-read
        # What the probe's quote is made of, near enough: the API's view may be re-read once
        # the load's first steps are published, a few steps' learning later.
        quoted_from = learned_estimate(gen_settings)
        # A loaded queue: five times what runs at once ahead of the probe.
        load = [submit(gen_client, auth, **job(i)) for i in range(100, 120)]
        accepted = post(gen_client, auth, input=job(999))
        assert accepted.status_code == 202, accepted.text
        estimated_ms = accepted.json()["estimated_wait_ms"]
        before = gen_client.get("/v1/jobs?limit=100", headers=auth).json()["data"]
        refused = post(
            gen_client, auth, input=job(1000), deadline_ms=max(1, int(estimated_ms / 10))
        )
        after = gen_client.get("/v1/jobs?limit=100", headers=auth).json()["data"]
        probe = result(gen_client, auth, accepted.json()["id"], wait_s=120)
        for job_id in load:
            result(gen_client, auth, job_id, wait_s=120)

    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["type"] == "deadline_unattainable"
    assert error["message"].startswith(f"deadline_ms: {max(1, int(estimated_ms / 10))} ms")
    assert {j["id"] for j in after} == {j["id"] for j in before}  # nothing stored
    assert probe["status"] == "succeeded"
    timings = probe["output"]["timings"]
    # ttft_ms counts from the job's creation, so it holds its queue_ms already.
    measured_ms = timings["ttft_ms"]
    assert measured_ms >= timings["queue_ms"]
    # The order of the wait, not its precision (a benchmark's business). The quote comes
    # from the step time learned in the warm-up, and the rest of the suite can make the
    # load's steps several times slower or faster than those were (full runs saw a quote
    # of 0.8 s for a wait of 3.1 s, and of 6.4 s for 1.1 s): so the quote is held to the
    # wait at the step time the probe itself decoded at (its tpot_ms), in place of the
    # learned one. On a quiet machine the two are alike and the quote 1.6-1.9 times short.
    assert timings["tpot_ms"] is not None, probe["output"]  # more than one token decoded
    rescaled_ms = estimated_ms * (timings["tpot_ms"] / 1000) / quoted_from.step_s(1)
    context = (estimated_ms, rescaled_ms, quoted_from, timings)
    assert measured_ms / 5 <= rescaled_ms <= measured_ms * 3, context
    learned = learned_estimate(gen_settings)
    assert learned.mean_completion_tokens >= 1


def learned_estimate(settings: Settings) -> GenerationEstimate:
    """What the model's generation workers have published (the hash the API quotes from)."""
    with redis.Redis.from_url(str(settings.redis_url)) as client:
        learned = GenerationEstimate.from_hash(stats_text(client, settings.key_prefix, MODEL))
    assert learned is not None, "no generation worker has published its estimate"
    return learned


def test_a_deadline_bounds_the_whole_generation_refused_or_accepted_with_fewer_tokens(
    gen_client: TestClient,
    auth: dict[str, str],
    gen_worker: Callable[..., Worker],
) -> None:
    def job(i: int, max_tokens: int = 32) -> dict[str, Any]:
        return {"prompt": f"job number {i} of the load", "max_tokens": max_tokens,
                "temperature": 0}  # fmt: skip

    with gen_worker():
        warm = [submit(gen_client, auth, **job(i)) for i in range(8)]
        for job_id in warm:
            assert result(gen_client, auth, job_id)["status"] == "succeeded"
        time.sleep(0.5)  # its figures published (every 250 ms), the API's view re-read
        # What running to 200 tokens is predicted to take: the refusal says.
        quote = post(gen_client, auth, input=job(1, 200), deadline_ms=1)
        assert quote.status_code == 429, quote.text
        finish_ms = quote.json()["error"]["estimated_wait_ms"]
        deadline = max(2, int(finish_ms / 2))
        refused = post(gen_client, auth, input=job(2, 200), deadline_ms=deadline)
        cut_body = {"input": job(3, 200), "deadline_ms": deadline, "on_deadline": "truncate",
                    "idempotency_key": "cut-once"}  # fmt: skip
        cut = post(gen_client, auth, **cut_body)
        assert cut.status_code == 202, cut.text
        accepted = cut.json()
        # A retry with the same key and body finds that job, cut as it was.
        again = post(gen_client, auth, **cut_body)
        assert again.status_code == 202, again.text
        assert again.headers["Idempotent-Replayed"] == "true"
        assert (again.json()["id"], again.json()["max_tokens"]) == (
            accepted["id"],
            accepted["max_tokens"],
        )
        ran = result(gen_client, auth, accepted["id"], wait_s=120)

    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["type"] == "deadline_unattainable"
    # Its first token would come in time; its 200th would not.
    assert "running to its max_tokens" in error["message"]
    assert error["estimated_wait_ms"] > deadline
    # Accepted with the largest max_tokens predicted to fit, said in the 202.
    assert 1 <= accepted["max_tokens"] < 200, accepted
    assert accepted["estimated_wait_ms"] <= deadline
    assert ran["status"] in ("succeeded", "expired"), ran  # a prediction, not a promise
    assert ran["output"]["usage"]["completion_tokens"] <= accepted["max_tokens"]
    # Without a deadline to meet, nothing is cut.
    whole = post(gen_client, auth, input=job(4, 200), on_deadline="truncate")
    assert whole.status_code == 202 and whole.json()["max_tokens"] is None, whole.text


def test_models_shows_the_execution_and_metrics_move_as_jobs_run(
    gen_settings: Settings,
    tmp_path: Path,
    auth: dict[str, str],
    gen_worker: Callable[..., Worker],
) -> None:
    from api.app import create_app

    # Two slots, so an urgent job preempts a running bulk one.
    two = generation_settings(gen_settings, tmp_path / "two", max_running=2, kv_blocks=40)
    names = {
        "tokens": "ferry_generation_tokens_total",
        "steps": "ferry_generation_steps_total",
        "step_s": "ferry_generation_step_seconds_count",
        "preempted": "ferry_generation_preemptions_total",
    }
    before = {key: sample(name) for key, name in names.items()}
    ttft_before = sample("ferry_generation_time_to_first_token_seconds_count", lane="urgent")
    tpot_before = sample("ferry_generation_time_per_output_token_seconds_count", lane="bulk")
    stopped_before = sample("ferry_generation_jobs_ended_total", finish_reason="length")
    with TestClient(create_app(two)) as client:
        shown = client.get(f"/v1/models/{MODEL}", headers=auth).json()["generation"]
        assert shown["execution"] is None and shown["step_fixed_ms"] is None
        bulk = [
            submit(client, auth, prompt=f"bulk {i}", max_tokens=60, priority="bulk")
            for i in range(2)
        ]
        with gen_worker(settings=two) as loop:
            ends = time.monotonic() + 60
            # The gauges are set after each step, from the scheduler's counts.
            while sample("ferry_generation_sequences", state="running") < 2:
                assert time.monotonic() < ends, "the bulk jobs never both ran"
                time.sleep(0.005)
            assert loop.engine.scheduler.running_count == 2
            assert sample("ferry_generation_kv_blocks_in_use") > 0
            urgent = submit(client, auth, prompt="urgent", max_tokens=4, priority="urgent")
            jobs = [result(client, auth, job_id) for job_id in [urgent, *bulk]]
            time.sleep(0.5)  # an idle step or two publish the last figures
            listed = client.get("/v1/models", headers=auth).json()["data"]
            assert (
                sample("ferry_generation_kv_blocks_budget")
                == loop.engine.scheduler.limits.kv_blocks
            )
    assert all(j["status"] == "succeeded" for j in jobs), jobs
    generated = sum(j["output"]["usage"]["completion_tokens"] for j in jobs)
    after = {key: sample(name) for key, name in names.items()}
    assert after["tokens"] - before["tokens"] == generated
    assert after["steps"] - before["steps"] >= 60  # a step per bulk token at least
    assert after["step_s"] - before["step_s"] == after["steps"] - before["steps"]
    assert after["preempted"] - before["preempted"] >= 1
    assert sample("ferry_generation_time_to_first_token_seconds_count", lane="urgent") == (
        ttft_before + 1
    )
    assert sample("ferry_generation_time_per_output_token_seconds_count", lane="bulk") == (
        tpot_before + 2
    )
    lengths = sum(1 for j in jobs if j["output"]["finish_reason"] == "length")
    assert sample("ferry_generation_jobs_ended_total", finish_reason="length") == (
        stopped_before + lengths
    )
    assert sample("ferry_generation_sequences", state="running") == 0
    assert sample("ferry_generation_kv_blocks_in_use") == 0
    (model,) = [m for m in listed if m["id"] == MODEL]
    assert model["generation"]["execution"] == "step"
    assert model["generation"]["why"] is None
    assert model["generation"]["prefix_caching"] is True  # the default, on a stepped model
    assert model["generation"]["step_fixed_ms"] > 0
    assert model["generation"]["step_per_token_ms"] >= 0


def test_a_generation_worker_shows_in_flower_with_its_sequences_and_token_rate(
    app: Celery,
    gen_client: TestClient,
    auth: dict[str, str],
    gen_worker: Callable[..., Worker],
    gen_settings: Settings,
) -> None:
    running = gen_worker("flower-gen")
    loop = running.loop
    presence = CeleryPresence(app, MODEL, loop.consumer.consumer, heartbeat_s=0.5)
    hostname = presence.hostname
    assert hostname == node_name(MODEL, "flower-gen")
    responder = ControlResponder(
        app, presence, gen_settings.key_prefix, lambda: generation_facts(loop),
        generation_conf(loop),
    )  # fmt: skip
    with Watcher(app) as watcher:
        presence.start()
        responder.start()
        try:
            watcher.until(lambda: hostname in watcher.state.workers)
            assert watcher.state.workers[hostname].alive
            inspect = app.control.inspect(destination=[hostname], timeout=3)
            ids = [submit(gen_client, auth, prompt=f"p {i}", max_tokens=40) for i in range(6)]
            # The loop is held after a step that left sequences running, while Flower's
            # inspect asks: its round trip may outlast all 40 tokens of every job.
            go_on, held = threading.Event(), threading.Event()
            step = loop.step

            def step_then_hold() -> None:
                step()
                if loop.engine.scheduler.running_count and not go_on.is_set():
                    held.set()
                    go_on.wait(60)

            loop.step = step_then_hold  # type: ignore[method-assign]
            with running:
                assert held.wait(60), "nothing ever ran"
                try:
                    busy = inspect.stats()[hostname]
                finally:
                    go_on.set()
                for job_id in ids:
                    result(gen_client, auth, job_id)
                idle = inspect.stats()[hostname]
            conf = inspect.conf()[hostname]
            assert watcher.state.workers[hostname].alive
        finally:
            responder.stop()
            presence.stop()
        watcher.until(lambda: not watcher.state.workers[hostname].alive, timeout_s=5)
    assert busy["model"] == MODEL and busy["device"] == "cpu"
    assert busy["stream_consumer"] == "flower-gen" and busy["ready"] is True
    assert busy["execution"] == "step"
    assert 1 <= busy["running_sequences"] <= 4
    assert busy["running_sequences"] + busy["waiting_sequences"] <= 6
    assert busy["tokens_per_s"] > 0
    assert idle["running_sequences"] == 0 and idle["waiting_sequences"] == 0
    assert idle["tokens"] >= 6
    assert conf["max_running"] == 4 and conf["prefetch"] >= 8
    assert not any("url" in key or "secret" in key for key in conf)
