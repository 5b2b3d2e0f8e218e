"""Each tenant's own stream in a lane, read in turn: one tenant's backlog is not another's wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.streams.protocol import JobMessage, Scripts, bulk_seq_key, stream_key
from core.streams.queues import arrivals, lane_depths, lane_tenants
from harness.services import started_redis
from tests.integration.conftest import RunningLoop, build_sim_loop, submit, wait_terminal
from tests.models import with_parameters
from workers.gpu import consumer as consumer_module
from workers.gpu.consumer import PRECISE_BELOW_MS, StreamConsumer

MODEL = "sim"


def enqueue(
    client: redis.Redis, settings: Settings, tenant: str, count: int, lane: str = "normal"
) -> list[str]:
    scripts = Scripts(client)
    now_ms = int(time.time() * 1000)
    ids = []
    for i in range(count):
        message = JobMessage(f"{tenant}-{i}", lane, 1, now_ms, tenant=tenant)
        scripts.enqueue(client, settings.key_prefix, MODEL, message)
        ids.append(message.job_id)
    return ids


def reader(client: redis.Redis, settings: Settings, name: str = "reader") -> StreamConsumer:
    consumer = StreamConsumer(client, settings.key_prefix, MODEL, name)
    consumer.ensure_groups()
    return consumer


def test_a_read_takes_an_equal_share_from_each_tenant(
    redis_client: redis.Redis, settings: Settings
) -> None:
    enqueue(redis_client, settings, "flood", 50)
    few = enqueue(redis_client, settings, "few", 2)
    got = reader(redis_client, settings).read(8, None)
    jobs = [entry.message.job_id for entry in got]
    assert len(jobs) == 8
    assert set(few) <= set(jobs)  # behind 50 of the flood's, still in the first read
    assert {entry.message.tenant for entry in got} == {"flood", "few"}
    # The room the small tenant could not use went to the other.
    assert sum(job.startswith("flood") for job in jobs) == 6
    assert lane_depths(redis_client, settings.key_prefix, MODEL)["normal"] == 52


def test_the_share_turns_when_tenants_outnumber_the_room(
    redis_client: redis.Redis, settings: Settings
) -> None:
    for name in "abcde":
        enqueue(redis_client, settings, name, 3)
    consumer = reader(redis_client, settings)
    firsts = [{entry.message.tenant for entry in consumer.read(2, None)} for _ in range(5)]
    assert all(len(tenants) == 2 for tenants in firsts)  # one each from two tenants
    assert set().union(*firsts) == set("abcde")  # and every tenant had a turn


def test_a_new_tenant_wakes_a_blocked_read(redis_client: redis.Redis, settings: Settings) -> None:
    consumer = reader(redis_client, settings)
    timer = threading.Timer(0.2, lambda: enqueue(redis_client, settings, "newcomer", 1))
    began = time.monotonic()
    timer.start()
    got = consumer.read(8, 5000)
    timer.join()
    assert [entry.message.job_id for entry in got] == ["newcomer-0"]
    assert time.monotonic() - began < 2.0  # not the 5 s block
    # The marker was taken off the wake stream.
    assert consumer.read(8, None) == []


def test_an_emptied_tenant_is_unlisted_and_comes_back_with_its_next_job(
    redis_client: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(consumer_module, "PRUNE_S", 0.0)
    consumer = reader(redis_client, settings)
    enqueue(redis_client, settings, "t1", 2)
    enqueue(redis_client, settings, "t2", 1)
    consumer.ack(consumer.read(8, None))  # t1 and t2 are now empty
    enqueue(redis_client, settings, "t2", 1)  # but t2 is not: only t1 goes
    consumer.read(8, None)
    consumer.read(8, None)  # the prune runs at the start of a read
    assert lane_tenants(redis_client, settings.key_prefix, MODEL)["normal"] == ["t2"]
    assert redis_client.exists(stream_key(settings.key_prefix, MODEL, "normal", "t1"))
    enqueue(redis_client, settings, "t1", 1)
    assert sorted(lane_tenants(redis_client, settings.key_prefix, MODEL)["normal"]) == ["t1", "t2"]
    assert [e.message.job_id for e in consumer.read(8, None)] == ["t1-0"]


def test_one_tenants_flood_does_not_hold_back_another_tenants_job(
    client: TestClient,
    make_token: Callable[[str], str],
    sessions: sessionmaker[Session],
    settings: Settings,
) -> None:
    flood_auth = {"Authorization": f"Bearer {make_token('flood')}"}
    other_auth = {"Authorization": f"Bearer {make_token('other')}"}
    # 200 jobs in batches of 8: 25 batches of at least 20 ms each.
    flood = [submit(client, flood_auth, model=MODEL, input={"cost": 1}) for _ in range(200)]
    slow = with_parameters(settings, "sim", latency_base_ms=20.0)
    with RunningLoop(build_sim_loop(slow)):
        time.sleep(0.1)  # the flood is being worked through
        mine = submit(client, other_auth, model=MODEL, input={"cost": 1})
        rows = wait_terminal(sessions, [mine, *flood], timeout=30)
    finished = rows[mine].finished_at
    assert finished is not None and rows[mine].status == "succeeded"
    created = rows[mine].created_at
    after = sum(1 for job in flood if (rows[job].finished_at or finished) > finished)
    # Most of the flood was still queued; the other tenant's job did not wait for it.
    assert after > 100, after
    # Counted in batches, not seconds (a loaded machine stretches every batch): while it
    # waited, a few batches of the flood finished (those computing, launched ahead or
    # being recorded when it came, and those of entries already read ahead), not the
    # flood's 25.
    meanwhile = sum(1 for job in flood if created < (rows[job].finished_at or created) <= finished)
    batch = settings.tuning.batch_max_size
    assert batch is not None
    assert meanwhile <= 8 * batch, meanwhile


class CountingClient(redis.Redis):
    """The real client, counting XREADGROUP calls."""

    reads = 0

    def xreadgroup(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return super().xreadgroup(*args, **kwargs)


def test_drained_tenants_cost_no_reads_until_they_get_a_job(
    redis_client: redis.Redis, settings: Settings
) -> None:
    assert settings.redis_url
    client = CountingClient(
        connection_pool=redis.ConnectionPool.from_url(settings.redis_url, decode_responses=True)
    )
    for number in range(300):
        enqueue(redis_client, settings, f"t{number}", 1)
    consumer = reader(client, settings)
    taken = consumer.read(400, None)
    assert len(taken) == 300
    consumer.ack(taken)
    client.reads = 0
    assert consumer.read(8, None) == []
    assert client.reads <= 4  # each lane's shared stream, not 300 drained tenants
    enqueue(redis_client, settings, "t42", 1)
    assert [e.message.job_id for e in consumer.read(8, None)] == ["t42-0"]


class EnqueuesAtFirstPoll:
    """The consumer's Redis client, which enqueues a job while answering the short wait's
    first poll of the enqueue counter (its only plain GET): the job arrives during the
    wait, whatever the machine's pace, never before it."""

    def __init__(self, client: redis.Redis, enqueue: Callable[[], object]) -> None:
        self.client = client
        self.enqueue = enqueue
        self.polls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def get(self, key: str) -> Any:
        value = self.client.get(key)
        self.polls += 1
        if self.polls == 1:
            self.enqueue()
        return value


def test_a_short_wait_returns_as_soon_as_a_job_is_enqueued(
    redis_client: redis.Redis, settings: Settings
) -> None:
    consumer = reader(redis_client, settings)
    enqueue(redis_client, settings, "early", 1)
    consumer.ack(consumer.read(8, None))
    # The same tenant's stream, so the job id repeats: the first entry was acknowledged.
    polled = EnqueuesAtFirstPoll(redis_client, lambda: enqueue(redis_client, settings, "early", 1))
    consumer.client = polled  # type: ignore[assignment]
    got = consumer.read(8, PRECISE_BELOW_MS - 1)
    assert [e.message.job_id for e in got] == ["early-0"]
    # Read at the poll after the job came (the wait is polled every few milliseconds),
    # not left for a later read.
    assert polled.polls >= 2


def test_many_messages_are_enqueued_as_one_by_one_would_enqueue_them(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """enqueue_all (a script call per tenant's stream) leaves Redis as enqueue, message by
    message, does: the same entries in order, the same sequence, one wake-up per new tenant."""
    now_ms = int(time.time() * 1000)
    messages = [
        JobMessage(f"{tenant}-{n}", lane, n + 1, now_ms, deadline_at_ms=now_ms + n, tenant=tenant)
        for n in range(300)  # past ENQUEUE_MANY_MAX for the first tenant
        for tenant, lane in (("a", "normal"), ("b", "vip"), (None, "normal"), ("c", "bulk"))
        if tenant == "a" or n < 5
    ]
    prefix = settings.key_prefix
    one_by_one, together = f"{prefix}-one", f"{prefix}-all"
    scripts = Scripts(redis_client)
    for message in messages:
        scripts.enqueue(redis_client, one_by_one, MODEL, message)
    pipe = redis_client.pipeline(transaction=False)
    scripts.enqueue_all(pipe, together, ((MODEL, message) for message in messages))
    scripts.execute(pipe)

    def entries(key: str) -> list[dict[str, str]]:
        found: Any = redis_client.xrange(key)
        return [dict(fields) for _id, fields in found]

    def state(prefix: str) -> dict[str, Any]:
        streams = {
            (lane, tenant): entries(stream_key(prefix, MODEL, lane, tenant))
            for lane, tenant in (("normal", "a"), ("vip", "b"), ("normal", None), ("bulk", "c"))
        }
        wakes = [fields["wake"] for fields in entries(f"{prefix}:{{{MODEL}}}:wake")]
        return {
            "streams": streams,
            "tenants": lane_tenants(redis_client, prefix, MODEL),
            "seq": redis_client.get(f"{prefix}:{{{MODEL}}}:seq"),
            "bulk": redis_client.get(bulk_seq_key(prefix, MODEL)),
            "arrivals": arrivals(redis_client, prefix, MODEL),
            "wakes": sorted(wakes),
        }

    found, expected = state(together), state(one_by_one)
    assert found == expected
    assert len(found["streams"][("normal", "a")]) == 300 and found["seq"] == str(len(messages))
    decoded = [JobMessage.decode(fields) for fields in found["streams"][("normal", "a")]]
    assert decoded == [m for m in messages if m.tenant == "a"]
    assert found["wakes"] == ["a", "b", "c"]
    # The arrival rate's counter leaves the bulk lane out (the feeder fills it on demand).
    assert found["arrivals"] == len([m for m in messages if m.lane != "bulk"])


def test_a_pipelined_enqueue_asks_no_script_check_and_outlives_a_flushed_script_cache(
    tmp_path: Path,
) -> None:
    """A group commit's pipeline sends its script calls as they are: no SCRIPT EXISTS before
    each (a round trip and a command a group). A Redis that has lost its scripts (restarted,
    failed over, flushed) answers NOSCRIPT and runs nothing; the calls are sent again once
    the scripts are loaded, so each message lands once, in order. On a Redis of its own: the
    shared one's script cache is every test's."""
    with started_redis(tmp_path) as url:
        client = redis.Redis.from_url(url, decode_responses=True)
        scripts = Scripts(client)
        messages = [JobMessage(f"job-{n}", "normal", 1, 0, tenant=f"t{n % 2}") for n in range(30)]

        def group_commit(group: list[JobMessage]) -> None:
            pipe = client.pipeline(transaction=False)
            scripts.enqueue_all(pipe, "p", (("sim", m) for m in group))
            scripts.execute(pipe)

        client.config_resetstat()
        group_commit(messages[:10])  # a fresh Redis: NOSCRIPT, loaded, sent again
        group_commit(messages[10:20])  # known now: nothing but the calls
        stats = client.info("commandstats")
        client.script_flush()
        group_commit(messages[20:])
        for tenant in ("t0", "t1"):
            found: Any = client.xrange(stream_key("p", "sim", "normal", tenant))
            assert [JobMessage.decode(fields) for _id, fields in found] == [
                m for m in messages if m.tenant == tenant
            ]
        client.close()
    assert "cmdstat_script|exists" not in stats
    # Two groups of two tenants: four script calls, the first two refused (NOSCRIPT),
    # sent again once the four scripts were loaded.
    assert stats["cmdstat_evalsha"]["calls"] == 6
    assert stats["cmdstat_evalsha"]["failed_calls"] == 2
    assert stats["cmdstat_script|load"]["calls"] == 4


def test_a_full_prefetch_still_reads_urgent_and_vip_entries_only(
    redis_client: redis.Redis, settings: Settings
) -> None:
    from scheduler import Batcher
    from workers.gpu.events import Observers
    from workers.gpu.intake import PRIORITY_ROOM, Intake

    enqueue(redis_client, settings, "flood", 40)
    consumer = reader(redis_client, settings)
    loop = build_sim_loop(settings.model_copy(update={"prefetch": 16}))
    batcher: Batcher[Any] = loop.batcher
    intake = Intake(consumer, batcher, Observers(), prefetch=16, visibility_timeout_s=60)
    intake.fill(None)
    assert len(batcher) == 16  # full of normal entries
    urgent = enqueue(redis_client, settings, "ops", 3, lane="urgent")
    vip = enqueue(redis_client, settings, "vip", 2, lane="vip")
    intake.fill(None)
    held = [entry.message.job_id for entry in batcher.payloads()]
    assert set(urgent + vip) <= set(held) and len(held) == 21  # no more normal ones
    # At most PRIORITY_ROOM beyond the prefetch, however many arrive.
    enqueue(redis_client, settings, "ops2", 20, lane="urgent")
    for _ in range(3):
        intake.fill(None)
    lanes = [entry.message.lane for entry in batcher.payloads()]
    assert lanes.count("normal") == 16 and len(lanes) == 16 + PRIORITY_ROOM
