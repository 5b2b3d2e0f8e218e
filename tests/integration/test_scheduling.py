"""The scheduler inside a real worker, and the API's admission control, on real Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.db.schema import Job
from tests.integration.conftest import RunningLoop, build_sim_loop, submit, wait_terminal
from tests.models import with_parameters

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


def submitter(client: TestClient, auth: dict[str, str], cost: int) -> Callable[[], Any]:
    def one() -> Any:
        response = client.post(
            "/v1/jobs", json={"model": "sim", "input": {"cost": cost}}, headers=auth
        )
        assert response.status_code == 202, response.text
        return response

    return one


def publish_then_stop(settings: Settings, one: Callable[[], Any]) -> None:
    """Start a worker until its estimates reach the API (a 202 carries estimated_wait_ms).

    It publishes its calibrated estimates when it starts; it is stopped right
    after, so the queue can build up.
    """
    until = time.monotonic() + 10
    with RunningLoop(build_sim_loop(settings)):
        while one().json()["estimated_wait_ms"] is None:
            assert time.monotonic() < until, "the worker never published its estimates"
            time.sleep(0.05)


@pytest.fixture
def slow_settings(settings: Settings) -> Settings:
    # 100 ms per batch plus 1 ms per unit of cost: easy to reason about.
    return with_parameters(settings, "sim", latency_base_ms=100.0, latency_per_cost_ms=1.0)


@pytest.fixture
def slow_client(slow_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(slow_settings)) as test_client:
        yield test_client


def test_each_202_carries_an_estimate_that_grows_with_the_queue(
    slow_client: TestClient,
    auth: dict[str, str],
    slow_settings: Settings,
    sessions: sessionmaker[Session],
) -> None:
    one = submitter(slow_client, auth, cost=10)
    publish_then_stop(slow_settings, one)
    estimates = [one().json()["estimated_wait_ms"] for _ in range(40)]
    assert all(e is not None and e > 0 for e in estimates)
    # 40 more jobs ahead (in batches of 8 at >= 100 ms each) must push it up by seconds.
    assert estimates[-1] > estimates[0] + 400, estimates
    assert estimates == sorted(estimates), estimates


def test_a_deadline_the_queue_cannot_meet_is_refused_with_429(
    slow_client: TestClient,
    auth: dict[str, str],
    slow_settings: Settings,
    sessions: sessionmaker[Session],
) -> None:
    publish_then_stop(slow_settings, submitter(slow_client, auth, cost=5))
    with sessions() as session:
        before = session.scalar(select(func.count()).select_from(Job))

    response = slow_client.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 5}, "deadline_ms": 50},
        headers=auth,
    )
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "deadline_unattainable"
    assert "deadline_ms" in error["message"]
    assert error["estimated_wait_ms"] > 50  # a batch alone takes over 100 ms
    with sessions() as session:  # nothing was stored or queued for it
        assert session.scalar(select(func.count()).select_from(Job)) == before

    # A deadline the estimate allows is accepted.
    ok = slow_client.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 5}, "deadline_ms": 60_000},
        headers=auth,
    )
    assert ok.status_code == 202, ok.text


def test_a_replay_is_answered_even_when_its_deadline_could_no_longer_be_met(
    slow_client: TestClient,
    auth: dict[str, str],
    slow_settings: Settings,
) -> None:
    one = submitter(slow_client, auth, cost=5)
    publish_then_stop(slow_settings, one)
    body = {"model": "sim", "input": {"cost": 5}, "deadline_ms": 1_000, "idempotency_key": "k"}
    first = slow_client.post("/v1/jobs", json=body, headers=auth)
    assert first.status_code == 202, first.text
    for _ in range(80):  # the queue grows past what the deadline allows
        one()
    fresh = slow_client.post("/v1/jobs", json={**body, "idempotency_key": "other"}, headers=auth)
    assert fresh.status_code == 429 and "deadline_ms" in fresh.text
    # The retry of the accepted job is its replay, not a refusal.
    replay = slow_client.post("/v1/jobs", json=body, headers=auth)
    assert replay.status_code == 202, replay.text
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == first.json()["id"]


def test_jobs_that_can_no_longer_finish_in_time_expire_without_running(
    settings: Settings, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    # Every batch takes 1.5 s. Accepted while no worker has published anything
    # (so no estimate and no refusal), the job's deadline is still a second
    # away when the worker sees it: too close for a 1.5 s batch.
    slow = with_parameters(settings, "sim", latency_base_ms=1500.0)
    with TestClient(create_app(slow)) as api:
        doomed = submit(api, auth, model="sim", input={"cost": 1}, deadline_ms=1000)
        fine = submit(api, auth, model="sim", input={"cost": 1})
    with RunningLoop(build_sim_loop(slow)):
        rows = wait_terminal(sessions, [doomed, fine])
    job = rows[doomed]
    assert job.status == "expired"
    assert job.error == "the deadline cannot be met"
    assert job.attempts == 0  # never ran
    assert job.finished_at is not None and job.deadline_at is not None
    assert job.finished_at < job.deadline_at  # given up early, not after the fact
    assert rows[fine].status == "succeeded"


def test_an_out_of_memory_batch_is_split_and_nobody_fails(
    settings: Settings, sessions: sessionmaker[Session], auth: dict[str, str]
) -> None:
    # The operator declared 8 GiB but the device really holds 100 units of cost
    # (64 MiB + 1 MiB per cost): the first full batch runs out of memory. The later
    # waves are submitted one job at a time while the worker runs: a 2 s window lets
    # their batches grow to the learned ceiling (and past what fits, once) however
    # slowly a loaded machine submits, as the first wave's did.
    capacity = 64 * 2**20 + 100 * 2**20
    oom = with_parameters(
        settings.model_copy(update={"batch_window_min_ms": 2000.0, "batch_window_max_ms": 2000.0}),
        "sim",
        memory_capacity_bytes=capacity,
    )
    loop = build_sim_loop(oom)
    ooms = []

    def wave() -> list[str]:
        return [submit(api, auth, model="sim", input={"cost": 40}) for _ in range(8)]

    with TestClient(create_app(oom)) as api:
        # The first wave is queued before the worker starts, so its first batch is
        # the full one however slowly a loaded machine submits.
        ids = wave()
        with RunningLoop(loop):
            for number in range(3):
                ids = ids if number == 0 else wave()
                rows = wait_terminal(sessions, ids)
                errors = {r.error for r in rows.values()}
                assert {r.status for r in rows.values()} == {"succeeded"}, errors
                ooms.append(loop.state.ooms)
    # The first wave ran out of memory and split; each lowered the ceiling,
    # until the scheduler stopped building batches that do not fit.
    assert ooms[0] >= 1
    assert ooms[2] == ooms[1], ooms
    assert loop.state.memory_ceiling < oom.tuning.memory_threshold * 8 * 2**30
    assert loop.state.profile(0.0).max_work * 2**20 + 64 * 2**20 <= capacity * 1.1


@pytest.mark.parametrize(("scheduler", "largest"), [("none", 1), ("fixed", 8), ("ferry", 8)])
def test_the_scheduler_setting_picks_the_policy(
    settings: Settings,
    sessions: sessionmaker[Session],
    auth: dict[str, str],
    scheduler: str,
    largest: int,
) -> None:
    chosen = settings.model_copy(update={"scheduler": scheduler})
    with TestClient(create_app(chosen)) as api:
        ids = [submit(api, auth, model="sim", input={"cost": 1}) for _ in range(16)]
    with RunningLoop(build_sim_loop(chosen)):
        rows = wait_terminal(sessions, ids)
    assert {r.status for r in rows.values()} == {"succeeded"}
    sizes = {r.batch_id: r.batch_size or 0 for r in rows.values()}
    assert max(sizes.values()) == largest, sizes
    assert sum(sizes.values()) == 16


def test_models_shows_live_workers_and_what_they_learned(
    slow_client: TestClient,
    auth: dict[str, str],
    slow_settings: Settings,
    sessions: sessionmaker[Session],
) -> None:
    one = submitter(slow_client, auth, cost=20)
    with RunningLoop(build_sim_loop(slow_settings)):
        ids = [one().json()["id"] for _ in range(10)]
        wait_terminal(sessions, ids)
        models = slow_client.get("/v1/models", headers=auth).json()["data"]
        sim = next(m for m in models if m["name"] == "sim")
        assert sim["workers"] == 1
    # The sim batch sleeps 100 ms + 1 ms per unit of cost: never less (a loaded
    # machine only oversleeps). After a handful of batches the fit still leans
    # on its prior, and the averages are moving averages: it must explain the
    # batches it saw roughly, not to the millisecond.
    assert 75.0 <= sim["latency_fixed_ms"] <= 400.0
    assert sim["latency_per_work_ms"] >= 0
    predicted_ms = sim["latency_fixed_ms"] + sim["latency_per_work_ms"] * 20 * sim["avg_batch_size"]
    assert predicted_ms == pytest.approx(sim["avg_batch_ms"], rel=0.4)
    assert 0 < sim["batch_efficiency"] <= 1
    assert sim["avg_batch_size"] >= 1
    after = slow_client.get("/v1/models", headers=auth).json()["data"]
    assert next(m for m in after if m["name"] == "sim")["workers"] == 0  # it said goodbye
