"""Redis Cluster: each model's keys share a slot (its hash tag), so models spread over the
shards; jobs of three models complete; and a model's slot moved to another primary in the
middle of a load loses nothing. Real redis-servers (three cluster primaries) on loopback
ports, the API in uvicorn, a sim worker per model, the reconciler as beat runs it, a real
PostgreSQL, Celery's broker on a Redis of its own; and `ferry up` with every part on it."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from redis.cluster import RedisCluster

from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import make_engine, make_sessionmaker
from core.streams.protocol import stream_key
from core.streams.target import REDIS_ERRORS, RedisSettings, RedisTarget, is_cluster
from harness import webclient
from harness.cluster import ClusterRedis, models_on_every_shard, reshard_under_load, sim_repository
from harness.served import served
from harness.services import started_redis
from harness.stack import FerryUp
from harness.worker import running_worker
from workers.tasks.feeder import Feeder


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterRedis]:
    with ClusterRedis(tmp_path / "cluster") as running:
        yield running


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[str]:
    with started_redis(tmp_path / "broker") as url:
        yield url


def jobs_and_a_backfill(
    client: httpx.Client, models: list[str], lines: int, feed: Callable[[], object],
    timeout_s: float,
) -> None:  # fmt: skip
    """A one-round-trip job of each model, then a backfill of ``lines`` of the last one
    (``feed`` called while it runs), each expected to succeed whole."""
    for model in models:
        answer = client.post("/v1/jobs?wait=30", json={"model": model, "input": {"cost": 2}})
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "succeeded"
    body = "".join(
        json.dumps({"custom_id": f"row-{i}", "input": {"cost": 1}}) + "\n" for i in range(lines)
    )
    created = client.post(
        "/v1/backfills", params={"model": models[-1]}, content=body,
        headers={"Content-Type": "application/x-ndjson"},
    )  # fmt: skip
    assert created.status_code == 202, created.text
    until = time.monotonic() + timeout_s
    while (found := client.get(f"/v1/backfills/{created.json()['id']}").json())[
        "status"
    ] != "completed":
        assert time.monotonic() < until, found
        feed()
        time.sleep(0.1)
    assert found["request_counts"]["completed"] == lines


def test_cluster_settings_and_the_clients_they_make(cluster: ClusterRedis) -> None:
    with pytest.raises(ValueError, match="FERRY_CELERY_BROKER_URL"):
        Settings(redis_url=cluster.url, redis_cluster=True)
    with pytest.raises(ValueError, match="exclude each other"):
        Settings(
            redis_url=cluster.url, redis_cluster=True, celery_broker_url="redis://b:6379/0",
            redis_sentinels="127.0.0.1:26379",
        )  # fmt: skip
    target = RedisTarget.of(
        Settings(redis_url=cluster.url, redis_cluster=True, celery_broker_url="amqp://b//").section(
            RedisSettings
        )
    )
    assert target.broker() == ("amqp://b//", {})
    host_port = cluster.url.removeprefix("redis://").removesuffix("/0")
    assert target.limits_uri() == (f"async+redis+cluster://{host_port}", {})
    assert target.describe() == f"cluster via redis://{host_port}"
    client = target.client(decode_responses=True)
    assert is_cluster(client) and isinstance(client, RedisCluster)
    # A command on any model's key reaches whichever primary holds it.
    for n in range(30):
        client.set(f"t:{{m{n}}}:k", n)
    assert [client.get(f"t:{{m{n}}}:k") for n in range(30)] == [str(n) for n in range(30)]
    assert len({cluster.owner(f"t:{{m{n}}}:k") for n in range(30)}) == 3
    # Keys of different slots in one atomic command are refused: Ferry never sends one.
    with pytest.raises(REDIS_ERRORS, match="same key slot"):
        client.mget("t:{m0}:k", "t:{m1}:k")
    client.close()


@pytest.fixture
def on_cluster(
    cluster: ClusterRedis, postgres_database: str, broker: str, tmp_path: Path
) -> Settings:
    """Settings for three sim models whose keys land one on each primary."""
    prefix = "cluster"
    models = models_on_every_shard(cluster, prefix)
    return Settings(
        redis_url=cluster.url,
        redis_cluster=True,
        celery_broker_url=broker,
        database_url=postgres_database,
        data_dir=tmp_path,
        key_prefix=prefix,
        model_repository=sim_repository(tmp_path / "models", models),
        models=",".join(models),
        model_parameters={m: {"latency_base_ms": 5.0, "latency_per_cost_ms": 0.1} for m in models},
        batch_max_size=8,
        reconcile_grace_s=2.0,
    )


def test_three_models_spread_over_the_shards_and_a_slot_moved_under_load_loses_nothing(
    cluster: ClusterRedis, on_cluster: Settings
) -> None:
    models = on_cluster.model_names
    run = reshard_under_load(cluster, on_cluster, models)
    # Each model on a shard of its own, until its slot moved; the moved one followed.
    assert sorted(run.before.values()) == sorted(cluster.ports)
    assert run.moved_keys > 3
    assert run.after[models[0]] != run.before[models[0]]
    assert {m: run.after[m] for m in models[1:]} == {m: run.before[m] for m in models[1:]}
    prefix = on_cluster.key_prefix
    assert cluster.owner(stream_key(prefix, models[0], "batch")) == run.after[models[0]]
    # Every model's jobs were accepted, and every accepted job succeeded, once.
    for model in models:
        assert len(run.accepted[model]) > 0.8 * run.sent / len(models), (model, run.refused)
    ids = [job_id for each in run.accepted.values() for job_id in each]
    statuses = {job.status for job in run.jobs.values()}
    assert len(run.jobs) == len(ids) and statuses == {"succeeded"}, statuses
    assert {job.model for job in run.jobs.values()} == set(models)
    assert [job.id for job in run.jobs.values() if job.attempts != 1] == []


def test_every_part_of_the_job_path_works_on_the_cluster(
    cluster: ClusterRedis, on_cluster: Settings
) -> None:
    """One-round-trip calls (the completion channel), a backfill fed by the feeder's
    scripts, rate limits, readiness and metrics, all on a cluster."""
    models = on_cluster.model_names
    settings = on_cluster.model_copy(update={"rate_limit": "60000/minute"})
    engine = make_engine(settings.sqlalchemy_url)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        auth = {"Authorization": f"Bearer {create_key(session, 'everything').token}"}
    target = RedisTarget.of(settings.section(RedisSettings))
    feeder = Feeder(sessions, target.client(decode_responses=True), settings.key_prefix,
                    outstanding=100, chunk=50, stale_upload_s=600.0)  # fmt: skip
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(served(settings))
        for model in models:
            stack.enter_context(running_worker(settings, model, f"{model}-worker"))
        client = stack.enter_context(webclient.client(base_url=api.base, headers=auth, timeout=30))
        # The worker's PUBLISH wakes the API's subscription; the feeder's scripts feed.
        jobs_and_a_backfill(client, models, 300, feeder.step, timeout_s=60)
        assert client.get("/readyz").status_code == 200
        metrics = client.get("/metrics").text
        for model in models:
            assert f'model="{model}"' in metrics
        # A failed authentication is counted in the cluster (the limits library's keys).
        # Each key's request counts and each address's failures, kept on whichever primary
        # serves their slots. Read while the stack runs: a window's keys expire with it, and
        # stopping the workers may take longer than a short window lasts. The library's
        # first call connects to the cluster within its short timeout; on a loaded machine
        # it may miss it, and the limits are then not checked for a few seconds (the log
        # says so): failures are sent until one is counted.
        nodes = [cluster.node(port) for port in cluster.ports]
        until = time.monotonic() + 60
        while True:
            refused = client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
            assert refused.status_code == 401
            kept = [key for node in nodes for key in node.keys("cluster:limits:*")]
            if any("auth-failures" in key for key in kept) or time.monotonic() > until:
                break
            time.sleep(0.5)
    assert any(":requests:" in key for key in kept) and any(
        "auth-failures" in key for key in kept
    ), kept
    engine.dispose()


def test_ferry_up_on_a_cluster_runs_every_part(
    cluster: ClusterRedis, broker: str, tmp_path: Path
) -> None:
    """`ferry up` with a cluster and Celery on a broker of its own: the API, a GPU worker per
    model, the Celery worker and beat (a backfill is fed by their feeder), and Flower, which
    finds every worker through Celery's broker."""
    prefix = "up"
    models = models_on_every_shard(cluster, prefix)
    (tmp_path / "up").mkdir()
    stack = FerryUp(
        tmp_path / "up",
        FERRY_REDIS_URL=cluster.url,
        FERRY_REDIS_CLUSTER="true",
        FERRY_CELERY_BROKER_URL=broker,
        FERRY_KEY_PREFIX=prefix,
        FERRY_MODEL_REPOSITORY=str(sim_repository(tmp_path / "models", models)),
        FERRY_MODELS=",".join(models),
    )
    try:
        stack.start()
        with webclient.client(
            base_url=stack.base, headers={"Authorization": f"Bearer {stack.token}"}, timeout=40
        ) as client:
            # Fed by the Celery worker and beat.
            jobs_and_a_backfill(client, models, 50, lambda: None, timeout_s=90)
        banner = "".join(stack.output)
        flower = re.search(r"Flower\s+(\S+)\s+\(user (\S+), password (\S+)\)", banner)
        assert flower, banner[-2000:]
        url, user, password = flower.groups()
        # The GPU workers as workers (their events and remote-control answers), the
        # Celery worker through its tasks' events.
        wanted = {f"ferry-{model}@" for model in models} | {"ferry-celery@"}
        until = time.monotonic() + 60
        while True:
            seen = set(
                webclient.get(f"{url}/api/workers", auth=(user, password), timeout=10).json()
            )
            tasks = webclient.get(f"{url}/api/tasks", auth=(user, password), timeout=10).json()
            seen |= {str(task.get("worker")) for task in tasks.values()}
            missing = {w for w in wanted if not any(name.startswith(w) for name in seen)}
            if not missing:
                break
            assert time.monotonic() < until, (missing, sorted(seen))
            time.sleep(1.0)
    finally:
        FerryUp.stop(stack.process)
