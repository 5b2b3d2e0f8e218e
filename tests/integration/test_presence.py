"""A GPU worker in Celery's event protocol, read back by Celery's own event receiver
(what Flower runs): online while it runs, offline when it stops, every batch a task."""

from __future__ import annotations

import ast
import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.events.state import State
from fastapi.testclient import TestClient

from core.settings import Settings
from tests.integration.conftest import RunningLoop, build_sim_loop
from workers.celery_app import celery_for_events
from workers.presence import CeleryPresence, node_name


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


@pytest.fixture
def app(settings: Settings) -> Iterator[Celery]:
    app = celery_for_events(settings)
    yield app
    app.close()


def test_a_worker_and_its_batches_show_as_a_celery_worker_and_tasks(
    app: Celery, settings: Settings, client: TestClient, auth: dict[str, str]
) -> None:
    consumer = f"test-{secrets.token_hex(4)}"
    hostname = node_name("sim", consumer)
    loop = build_sim_loop(settings, consumer)
    presence = CeleryPresence(app, "sim", consumer, heartbeat_s=0.5)
    loop.events = presence
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


def test_an_unreachable_broker_never_holds_up_the_worker(settings: Settings) -> None:
    unreachable = settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    presence = CeleryPresence(celery_for_events(unreachable), "sim", "nowhere", heartbeat_s=0.2)
    presence.start()
    started = time.monotonic()
    for number in range(200):
        presence.batch_started(f"b{number}", 1, 1, ["normal"], 0.01)
        presence.batch_finished(f"b{number}", 0.01, 1, 0)
    assert time.monotonic() - started < 0.5
    presence.stop(timeout_s=10)
    assert presence.dropped > 0


def _kwargs(task: Any) -> dict[str, Any]:
    return dict(ast.literal_eval(task.kwargs))
