"""A GPU worker in Celery's event protocol, read back by Celery's own event receiver
(what Flower runs): online while it runs, offline when it stops, every batch a task."""

from __future__ import annotations

import ast
import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.events.state import State
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from core.config.settings import Settings
from core.streams.broker import celery_for_events
from core.streams.target import RedisTarget
from tests.integration.conftest import RunningLoop, build_sim_loop
from workers.gpu.control import ControlResponder
from workers.gpu.loop import BatchLoop
from workers.gpu.main import worker_conf, worker_facts
from workers.gpu.presence import QUEUE_MAX, CeleryPresence, node_name

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


class Watcher:
    """Celery's event receiver and state, in a thread: what Flower sees."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.state = State()
        self.ready = threading.Event()
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection() as connection:
            self.receiver = self.app.events.Receiver(connection, handlers={"*": self.state.event})
            self.ready.set()
            with contextlib.suppress(Exception):  # the connection closes under it at the end
                self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> Watcher:
        self.thread.start()
        assert self.ready.wait(10)
        # The receiver's queue is bound once it consumes; give it that moment.
        time.sleep(0.5)
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(5)

    def until(self, check: Callable[[], bool], timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, "the events never showed it"
            time.sleep(0.05)


def _worker(app: Celery, settings: Settings) -> tuple[BatchLoop, CeleryPresence]:
    """A sim worker loop of its own name, reporting through Celery events (fast heartbeats)."""
    consumer = f"test-{secrets.token_hex(4)}"
    loop = build_sim_loop(settings, consumer)
    presence = CeleryPresence(app, "sim", consumer, heartbeat_s=0.5)
    loop.observers.add(presence)
    return loop, presence


def test_a_worker_and_its_batches_show_as_a_celery_worker_and_tasks(
    app: Celery, settings: Settings, client: TestClient, auth: dict[str, str]
) -> None:
    loop, presence = _worker(app, settings)
    hostname, consumer = presence.hostname, loop.consumer.consumer
    assert hostname == node_name("sim", consumer) == f"ferry-sim@{consumer}"
    with Watcher(app) as watcher:
        presence.start()
        watcher.until(lambda: hostname in watcher.state.workers)
        worker = watcher.state.workers[hostname]
        assert worker.alive
        assert worker.freq == 0.5

        def submit(body: dict[str, Any]) -> str:
            response = client.post("/v1/jobs", json={"model": "sim", **body}, headers=auth)
            assert response.status_code == 202, response.text
            return str(response.json()["id"])

        ids = [submit({"input": {"cost": 3}}) for _ in range(5)]
        ids += [submit({"input": {"cost": 1}, "priority": "urgent"})]
        with RunningLoop(loop):
            for job_id in ids:
                client.get(f"/v1/jobs/{job_id}?wait=10", headers=auth)
            failing = submit({"input": {"cost": 1, "fail": True}})
            client.get(f"/v1/jobs/{failing}?wait=10", headers=auth)

            def batches() -> list[Any]:
                return [
                    task
                    for task in watcher.state.tasks.values()
                    if task.worker is not None and task.worker.hostname == hostname
                ]

            watcher.until(
                lambda: sum(_kwargs(t)["size"] for t in batches() if t.ready) == len(ids) + 1
            )
            # Heartbeats keep it online for longer than the 2 x freq expiry.
            time.sleep(1.5)
            assert watcher.state.workers[hostname].alive

        done = batches()
        assert {t.name for t in done} == {"ferry.batch.sim"}
        rows = {
            job["id"]: job for job in client.get("/v1/jobs?limit=50", headers=auth).json()["data"]
        }
        # Task ids are the batch ids the jobs record.
        assert {t.uuid for t in done} == {rows[job_id]["batch"]["id"] for job_id in [*ids, failing]}
        failed = [t for t in done if t.state == "FAILURE"]
        assert [t.uuid for t in failed] == [rows[failing]["batch"]["id"]]
        assert "1 of 1 jobs failed" in failed[0].exception
        for task in done:
            kwargs = _kwargs(task)
            assert kwargs["size"] == sum(kwargs["lanes"].values())
            assert kwargs["cost"] >= kwargs["size"]
            assert task.runtime > 0
            assert task.started is not None
            if task.state == "SUCCESS":
                assert ast.literal_eval(task.result) == {"succeeded": kwargs["size"]}
        lanes = {lane for t in done for lane in _kwargs(t)["lanes"]}
        assert lanes == {"normal", "urgent"}

        presence.stop()
        watcher.until(lambda: not watcher.state.workers[hostname].alive, timeout_s=5)
    assert presence.dropped == 0


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """A 'Redis' that accepts connections and never answers (hung, or half-open)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()
    for connection in accepted:
        connection.close()


@pytest.mark.parametrize("broker", ["refused", "silent"])
def test_a_broker_that_is_down_or_hung_never_holds_up_the_worker(
    silent_broker: str, broker: str
) -> None:
    url = "redis://127.0.0.1:1/0" if broker == "refused" else silent_broker
    presence = CeleryPresence(
        celery_for_events(RedisTarget(url)), "sim", "nowhere",
        heartbeat_s=0.2,
    )  # fmt: skip
    dropped_before = _dropped("sim")
    presence.start()
    started = time.monotonic()
    # More than the queue holds: the rest is dropped, never waited for.
    for number in range(QUEUE_MAX):
        presence.task_started(f"b{number}", 1, 1, ["normal"], 0.01)
        presence.task_finished(f"b{number}", 0.01, 1, 0)
    assert time.monotonic() - started < 2.0
    stopping = time.monotonic()
    presence.stop(timeout_s=3)
    assert time.monotonic() - stopping < 4.0
    assert presence.dropped >= QUEUE_MAX
    assert _dropped("sim") - dropped_before == presence.dropped


def _dropped(model: str) -> float:
    return REGISTRY.get_sample_value("ferry_worker_events_dropped_total", {"model": model}) or 0.0


def _kwargs(task: Any) -> dict[str, Any]:
    return dict(ast.literal_eval(task.kwargs))


def test_a_worker_answers_the_inspections_flower_makes(
    app: Celery, settings: Settings, client: TestClient, auth: dict[str, str]
) -> None:
    loop, presence = _worker(app, settings)
    hostname, consumer = presence.hostname, loop.consumer.consumer
    responder = ControlResponder(
        app, presence, settings.key_prefix, lambda: worker_facts(loop),
        worker_conf(settings.for_model("sim"), loop),
    )  # fmt: skip
    presence.start()
    responder.start()
    try:
        inspect = app.control.inspect(destination=[hostname], timeout=3)
        deadline = time.monotonic() + 10
        while not (inspect.ping() or {}).get(hostname):
            assert time.monotonic() < deadline, "the worker never answered a ping"
        job = client.post(
            "/v1/jobs", json={"model": "sim", "input": {"cost": 2}}, headers=auth
        ).json()
        with RunningLoop(loop):
            assert client.get(f"/v1/jobs/{job['id']}?wait=10", headers=auth).json()["status"] == (
                "succeeded"
            )
            # The batch counts once the loop has told its observers and learned from it,
            # just after writing the job's result, which may have answered the long-poll first.
            counted = {"total": {"ferry.batch.sim": 1}, "batches": 1, "jobs": 1}
            deadline = time.monotonic() + 10
            while True:
                stats = inspect.stats()[hostname]
                if {key: stats[key] for key in counted} == counted:
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
            # Asked to stop: not ready at once, while it finishes what it holds.
            assert loop.ready.is_set()
            loop.request_stop()
            assert not loop.ready.is_set()
        assert stats["model"] == "sim"
        assert stats["stream_consumer"] == consumer
        assert "password" not in str(stats["broker"])
        assert set(stats["broker"]) == {"transport", "hostname", "port", "virtual_host"}
        queues = inspect.active_queues()[hostname]
        assert [q["routing_key"] for q in queues] == ["urgent", "vip", "normal", "bulk"]
        assert all(q["name"].startswith(f"{settings.key_prefix}:") for q in queues)
        assert inspect.registered()[hostname] == ["ferry.batch.sim"]
        assert inspect.active()[hostname] == []
        conf = inspect.conf()[hostname]
        assert conf["scheduler"] == settings.scheduler
        assert conf["batch_max_size"] == settings.tuning.batch_max_size
        assert not any("url" in key or "secret" in key for key in conf)
        # What would change a Celery worker does not apply; it is answered, not ignored.
        refused = app.control.broadcast(
            "pool_grow", arguments={"n": 1}, destination=[hostname], reply=True, timeout=3
        )
        assert "does not apply" in refused[0][hostname]["error"]
    finally:
        responder.stop()
        presence.stop()
