"""Ferry on many test hosts: Redis, PostgreSQL, two API hosts, two sim-worker hosts and a
Celery host, each in a network namespace of its own on a bridge of its own (a /24 of the
benchmarking range, 198.18.0.0/16, no other network holds); links cut and restored. Root
only: skipped with the reason elsewhere, required under CI=true."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import Engine

from core.db import migrate
from core.db.keys import create_key
from core.db.schema import (
    CONNECT_TIMEOUT_S,
    SILENT_HOST_TIMEOUT_S,
    Job,
    make_engine,
    make_sessionmaker,
)
from core.streams.protocol import GROUP, done_channel
from core.streams.queues import model_streams
from harness import netns, webclient
from harness.listener import DoneListener
from harness.netns import Deployment, Host, Network, wait_until
from harness.processes import stopped_when
from tests.streams import held_jobs
from workers.gpu.executions import read_executions

pytestmark = pytest.mark.multihost

Deploy = Callable[..., Deployment]
# What a worker logs when it gives a batch up unrecorded (its entries left to run again),
# or recorded and not acknowledged (its entries read again and found finished).
GIVEN_UP = (
    "a batch's results were not recorded; its jobs run again",
    "a batch's entries were not acknowledged",
)


def given_up(log: str) -> int:
    return sum(log.count(line) for line in GIVEN_UP)


@pytest.fixture
def deploy(tmp_path: Path) -> Iterator[Deploy]:
    with contextlib.ExitStack() as stack:

        def start(**settings: str) -> Deployment:
            net = stack.enter_context(Network(tmp_path))
            hosts = Deployment(net, sys.executable, **settings)
            hosts.start_redis()
            hosts.start_postgres()
            admin = create_engine(
                hosts.database_url.replace("/ferry", "/postgres"), isolation_level="AUTOCOMMIT"
            )

            def answers() -> bool:
                with admin.connect():
                    return True

            try:
                wait_until("PostgreSQL to answer", answers, 60)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{hosts.postgres.log('postgres')}") from None
            with admin.connect() as conn:
                conn.execute(text("CREATE DATABASE ferry"))
            admin.dispose()
            migrate.upgrade(hosts.database_url)
            for api in hosts.apis:
                hosts.start_api(api)
            for worker in hosts.workers:
                hosts.start_worker(worker)
            hosts.start_celery()
            for api in hosts.apis:
                wait_until(
                    f"{api.name} to be ready",
                    lambda url=hosts.api_url(api): (
                        webclient.get(f"{url}/readyz", timeout=2).is_success
                    ),
                    90,
                )
            return hosts

        yield start


def submit(hosts: Deployment, engine: Engine, api: Host, count: int, cost: int = 4) -> list[str]:
    with make_sessionmaker(engine)() as session:
        token = create_key(session, f"key-{api.name}").token
    ids = []
    with webclient.client(
        base_url=hosts.api_url(api), headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as client:
        for _ in range(count):
            answer = client.post("/v1/jobs", json={"model": "sim", "input": {"cost": cost}})
            assert answer.status_code == 202, answer.text
            ids.append(answer.json()["id"])
    return ids


def succeeded(engine: Engine, ids: list[str]) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(Job)
                .where(Job.id.in_(ids), Job.status == "succeeded")
            ).scalar_one()
        )


def test_jobs_submitted_to_both_apis_complete_on_both_workers(deploy: Deploy) -> None:
    hosts = deploy(FERRY_BATCH_MAX_SIZE="16")
    engine = make_engine(hosts.database_url)
    ids = [job for api in hosts.apis for job in submit(hosts, engine, api, 100)]
    wait_until("every job to finish", lambda: succeeded(engine, ids) == len(ids), 90)
    with engine.connect() as conn:
        rows = conn.execute(select(Job.batch_id, Job.attempts).where(Job.id.in_(ids))).all()
    engine.dispose()
    assert all(attempts == 1 for _, attempts in rows)
    # Both worker hosts took part (each logs its batches).
    for worker in hosts.workers:
        assert "batch done" in worker.log("worker", 200_000), worker.log("worker")


def running_held_by(client: redis.Redis, engine: Engine, consumer: str) -> list[str]:
    """The jobs the consumer holds (read, not acknowledged) whose rows say running at their
    first attempt: a batch it claimed and computes, or records. (Entries read but not yet
    claimed are not enough: cut there, it computes nothing.)"""
    held = held_jobs(client, "ferry", "sim", consumer)
    if not held:
        return []
    with engine.connect() as conn:
        return list(
            conn.scalars(
                select(Job.id).where(Job.id.in_(held), Job.status == "running", Job.attempts == 1)
            )
        )


def pending(client: redis.Redis) -> int:
    """Entries of sim's streams read by a worker and not yet acknowledged."""
    count = 0
    for stream in model_streams(client, "ferry", "sim"):
        with contextlib.suppress(redis.ResponseError):
            count += int(client.xpending(stream, GROUP)["pending"])
    return count


def cut_mid_batch(
    client: redis.Redis, engine: Engine, host: Host, worker: subprocess.Popen[bytes]
) -> list[str]:
    """Cut ``host`` off while its worker computes a batch it claimed; the jobs of that batch.

    The worker is stopped with a batch (harness.processes.stopped_when), its host cut while
    it is stopped, and it goes on (SIGCONT), computing a batch it can no longer write."""
    held = stopped_when(
        worker.send_signal,
        lambda: running_held_by(client, engine, host.name),
        f"{host.name} to run a batch",
    )
    host.cut()  # it computes on, but reaches neither Redis nor PostgreSQL
    worker.send_signal(signal.SIGCONT)
    return held


def test_a_worker_cut_off_mid_batch_is_taken_over_and_its_late_result_refused(
    deploy: Deploy, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    records = tmp_path / "executions"
    hosts = deploy(
        FERRY_BATCH_MAX_SIZE="8",
        FERRY_VISIBILITY_TIMEOUT_S="4",
        FERRY_SIM_LATENCY_BASE_MS="3000",
        FERRY_EXECUTION_LOG_DIR=str(records),
    )
    engine = make_engine(hosts.database_url)
    client = redis.Redis.from_url(hosts.redis_url, decode_responses=True)
    # Who wrote which job, as the workers announce it (only when their write won).
    recorded = DoneListener(done_channel("ferry"))
    recorded.start(hosts.redis_url)
    request.addfinalizer(recorded.stop)
    cut = hosts.workers[0]
    ids = submit(hosts, engine, hosts.apis[0], 32, cost=1)
    given_up_before = given_up(cut.log("worker", 10**8))
    computed = cut_mid_batch(client, engine, cut, hosts.worker_processes[cut.name])
    # The other host takes the cut one's entries over once they are older than the
    # visibility timeout, and every job finishes while the link is still down (the
    # timeout is for a hang, not a promise of how soon).
    wait_until("every job to finish", lambda: succeeded(engine, ids) == len(ids), 180)
    batches_before = cut.log("worker", 10**8).count("batch done")
    cut.restore()
    # The cut worker's result write is retried until the database answers again: it
    # finds its jobs already written at a later attempt, and changes nothing; then it
    # logs the batch done. A packet it sent into the cut is resent on TCP's backoff,
    # which doubles up to two minutes: the wait is for a hang, not for how soon. A cut
    # that outlasts the worker's retries (a loaded machine) makes it give the batch up
    # unacknowledged instead, maybe before the link is back, and its entries run again:
    # either is right, as long as nothing is lost and nothing is written twice.

    def recorded_or_given_up() -> bool:
        log = cut.log("worker", 10**8)
        return log.count("batch done") > batches_before or given_up(log) > given_up_before

    try:
        wait_until(
            f"{cut.name} to record its batch once back, or give it up", recorded_or_given_up, 180
        )
        # Recorded or run again, every entry read is acknowledged in the end.
        wait_until("every entry to be acknowledged", lambda: pending(client) == 0, 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cut.log('worker', 20_000)}") from None
    assert hosts.worker_processes[cut.name].poll() is None, cut.log("worker")
    with engine.connect() as conn:
        rows = {
            job_id: (status, attempts)
            for job_id, status, attempts in conn.execute(
                select(Job.id, Job.status, Job.attempts).where(Job.id.in_(ids))
            )
        }
    engine.dispose()
    client.close()
    announced = recorded.snapshot()
    assert {status for status, _ in rows.values()} == {"succeeded"}, "a job was lost"
    assert not [job for job in ids if announced[job] > 1], "a job was written twice"
    stale = {
        job_id
        for execution in read_executions(records)
        if execution.worker == cut.name
        for job_id, attempt in execution.jobs
        if attempt == 1 and rows[job_id][1] > 1
    }
    # The cut worker computed a batch whose jobs were then claimed again and written by
    # the other host: the row holds the later attempt, the stale result was refused.
    assert stale, "the cut worker computed nothing the other host took over"
    assert stale >= set(computed), "the batch cut mid-way was not taken over"
    taken = [job_id for job_id, (_, attempts) in rows.items() if attempts > 1]
    assert set(taken) >= stale


def test_an_api_host_cut_from_redis_keeps_accepting_and_its_jobs_run(deploy: Deploy) -> None:
    hosts = deploy(FERRY_RECONCILE_INTERVAL_S="1", FERRY_RECONCILE_GRACE_S="2")
    engine = make_engine(hosts.database_url)
    api = hosts.apis[0]
    api.block(hosts.redis.address)
    # Every submission is committed to the database first: accepted while Redis is out
    # of reach; the reconciler (on the Celery host, which reaches Redis) enqueues them.
    ids = submit(hosts, engine, api, 20)
    wait_until("the jobs to run", lambda: succeeded(engine, ids) == len(ids), 60)
    api.unblock(hosts.redis.address)
    with engine.connect() as conn:
        attempts = conn.execute(select(Job.attempts).where(Job.id.in_(ids))).scalars().all()
    engine.dispose()
    assert sorted(attempts) == [1] * len(ids)
    assert "enqueue failed; the reconciler will enqueue the jobs" in api.log("api", 200_000)
    assert "re-enqueued jobs whose stream entry was lost" in hosts.celery.log("worker", 200_000)


# Longer than the API gives a silent database host, with room to spare: a statement sent
# as the host stops is abandoned (and its submissions refused) before the host is back.
OUTAGE_S = SILENT_HOST_TIMEOUT_S + CONNECT_TIMEOUT_S


def test_the_postgresql_host_stopped_under_load_loses_nothing(deploy: Deploy) -> None:
    hosts = deploy(FERRY_BATCH_MAX_SIZE="16")
    engine = make_engine(hosts.database_url)
    with make_sessionmaker(engine)() as session:
        token = create_key(session, "load").token
    accepted: list[str] = []
    refused = 0
    # The outage keeps its own clock: 3 s into the load, for OUTAGE_S, whatever the
    # clients are waiting on (a refused submission takes the API's database timeout).
    outage = [
        threading.Timer(3, hosts.postgres.cut),
        threading.Timer(3 + OUTAGE_S, hosts.postgres.restore),
    ]
    for timer in outage:
        timer.start()
    try:
        started = time.monotonic()
        with contextlib.ExitStack() as clients:
            sessions = [
                clients.enter_context(
                    webclient.client(
                        base_url=hosts.api_url(api),
                        headers={"Authorization": f"Bearer {token}"},
                        timeout=30,
                    )
                )
                for api in hosts.apis
            ]
            number = 0
            while time.monotonic() - started < 3 + OUTAGE_S + 5:
                number += 1
                key = f"job-{number}"
                # A refused submission is retried with its idempotency key, as a client would,
                # until it is accepted (the outage ends; a hang meets the deadline).
                deadline = time.monotonic() + 60
                while True:
                    answer = sessions[number % 2].post(
                        "/v1/jobs",
                        json={"model": "sim", "input": {"cost": 2}},
                        headers={"Idempotency-Key": key},
                    )
                    if answer.status_code == 202:
                        accepted.append(answer.json()["id"])
                        break
                    assert answer.status_code == 503, answer.text
                    refused += 1
                    assert time.monotonic() < deadline, f"{key} refused for 60 s"
                    time.sleep(0.5)
                time.sleep(0.03)
    finally:
        # Whatever ended the load, the timers are done with and the link is up.
        for timer in outage:
            timer.cancel()
            timer.join()
        hosts.postgres.restore()
    wait_until(
        "every accepted job to finish",
        lambda: succeeded(engine, accepted) == len(set(accepted)),
        90,
    )
    with engine.connect() as conn:
        attempts = conn.execute(select(Job.attempts).where(Job.id.in_(accepted))).scalars().all()
    engine.dispose()
    assert refused > 0, "the outage turned no submission away"
    assert len(set(accepted)) == len(accepted)  # each key accepted once
    assert len(attempts) == len(accepted) and max(attempts) == 1


def test_a_killed_runs_network_left_on_a_free_subnet_is_cleared_for_the_next(
    tmp_path: Path,
) -> None:
    """A test killed outright never tears its network down: its bridge still holds the
    subnet whose lock its death freed, and would take the next network's packets (every
    host unreachable). The next network on that subnet removes it, hosts and all."""
    subnet, lock = netns.claim_subnet()
    stale = "fbrdead"
    namespace = "ferry-dead-redis"
    netns._ip("link", "add", stale, "type", "bridge")
    try:
        netns._ip("addr", "add", f"{subnet}.1/24", "dev", stale)
        netns._ip("link", "set", stale, "up")
        netns._ip("netns", "add", namespace)
        orphan = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "300"])
        lock.close()  # its owner is gone
        with Network(tmp_path) as net:
            assert net.subnet == subnet
            assert orphan.wait(timeout=10) != 0  # killed with its namespace
            assert subprocess.run(["ip", "link", "show", stale], capture_output=True).returncode
            listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
            assert namespace not in listing.stdout
            host = net.host("redis")
            host.spawn(
                ["redis-server", "--bind", host.address, "--port", "6379", "--save", "",
                 "--protected-mode", "no"]
            )  # fmt: skip
            client = redis.Redis(host=host.address, socket_timeout=2)
            wait_until("the new network's host to answer", client.ping, 30)
    finally:
        netns.remove_stale_network(stale)  # a no-op once the test has passed
