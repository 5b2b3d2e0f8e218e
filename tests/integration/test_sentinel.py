"""Redis with Sentinel: the primary is killed under steady load, a replica is promoted, and
every part follows it. Real redis-servers (a primary, a replica, three sentinels) on loopback
ports, the API in uvicorn, a sim worker, the reconciler as beat runs it, a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from core.config.settings import Settings
from core.streams.broker import celery_on_broker
from core.streams.target import RedisSettings, RedisTarget
from harness.sentinel import SentinelRedis, failover_under_load


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelRedis]:
    with SentinelRedis(tmp_path / "redis") as running:
        yield running


def test_settings_and_clients_follow_the_sentinels() -> None:
    target = RedisTarget.of(
        Settings(
            redis_sentinels="127.0.0.1:26379,127.0.0.1:26380",
            redis_sentinel_service="cache",
            redis_url="redis://:s3cret@ignored:6379/2",
        ).section(RedisSettings)
    )
    assert target.sentinels == (("127.0.0.1", 26379), ("127.0.0.1", 26380))
    url, options = target.broker()
    assert url == "sentinel://:s3cret@127.0.0.1:26379/2;sentinel://:s3cret@127.0.0.1:26380/2"
    assert options == {"master_name": "cache"}
    uri, limits = target.limits_uri()
    assert uri == "async+redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/cache"
    assert limits["use_replicas"] is False and (limits["password"], limits["db"]) == ("s3cret", 2)
    assert limits["sentinel_kwargs"]["socket_timeout"] == 0.25  # a silent sentinel costs little
    # Credentials are quoted in kombu's URLs, which it splits at ';', '@' and ':'.
    odd = RedisTarget.of(
        Settings(redis_sentinels="h:1", redis_url="redis://:p%40ss%3Bw@x:6379/0").section(
            RedisSettings
        )
    ).broker()[0]
    assert odd == "sentinel://:p%40ss%3Bw@h:1/0"
    assert "s3cret" not in target.describe()
    with pytest.raises(ValueError, match="FERRY_REDIS_URL"):
        RedisTarget.of(Settings().section(RedisSettings))


def test_a_killed_primary_is_followed_and_nothing_is_lost_or_run_twice(
    sentinel: SentinelRedis, postgres_database: str, tmp_path: Path
) -> None:
    settings = Settings(
        redis_sentinels=sentinel.sentinels,
        database_url=postgres_database,
        data_dir=tmp_path,
        key_prefix="sentinel",
        models="sim",
        model_parameters={"sim": {"latency_base_ms": 5.0, "latency_per_cost_ms": 0.1}},
        batch_max_size=8,
        reconcile_grace_s=2.0,
    )
    run = failover_under_load(sentinel, settings)
    assert run.promoted != run.killed
    assert len(run.accepted) > 0.8 * run.sent, (len(run.accepted), run.sent, run.refused)
    statuses = {job.status for job in run.jobs.values()}
    assert len(run.jobs) == len(run.accepted) and statuses == {"succeeded"}, statuses
    # Some were accepted while no primary answered: the database had them, and the
    # reconciler enqueued them again.
    assert run.requeued > 0
    # Each ran once: one attempt each.
    assert [job.id for job in run.jobs.values() if job.attempts != 1] == []
    # Jobs flowed again: a job accepted after the kill finished, soon.
    assert run.recovered_s is not None and run.recovered_s < 30, run.recovered_s
    # Celery (and Flower, on the same broker settings) reach the promoted primary.
    app = celery_on_broker(RedisTarget.of(settings.section(RedisSettings)))
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=3)
        assert connection.default_channel.client.info("server")["tcp_port"] == run.promoted
