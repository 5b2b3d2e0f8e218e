"""Backfills against a real Redis and real databases: upload, feed, run, results, cancel.

The feeder runs here in-process, as the Celery task runs it; the end-to-end
and fault tests run it under Celery.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Backfill, Job, WebhookDelivery
from core.streams.queues import lane_depths
from harness.threads import OnAThread
from tests.integration.conftest import RunningLoop
from workers.tasks.feeder import Feeder


def ndjson(count: int, start: int = 0, **extra: Any) -> bytes:
    lines = [
        json.dumps({"custom_id": f"row-{i}", "input": {"cost": 1 + i % 4, **extra}})
        for i in range(start, start + count)
    ]
    return ("\n".join(lines) + "\n").encode()


def upload(client: TestClient, auth: dict[str, str], body: bytes, **params: str) -> Any:
    return client.post(
        "/v1/backfills",
        params={"model": "sim", **params},
        content=body,
        headers={**auth, "Content-Type": "application/x-ndjson"},
    )


def make_feeder(
    sessions: sessionmaker[Session], redis_client: redis.Redis, settings: Settings, **kw: Any
) -> Feeder:
    options: dict[str, Any] = {"outstanding": 300, "chunk": 100, "stale_upload_s": 600.0}
    options.update(kw)
    return Feeder(sessions, redis_client, settings.key_prefix, **options)


class RunningFeeder(OnAThread):
    def __init__(self, feeder: Feeder) -> None:
        self.feeder = feeder
        self.max_live = 0
        super().__init__(self._run, join_s=10)

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.feeder.step()
            live = lane_depths(self.feeder.client, self.feeder.prefix, "sim")["bulk"]
            self.max_live = max(self.max_live, live)
            time.sleep(0.02)


@pytest.fixture
def feeder(
    sessions: sessionmaker[Session], redis_client: redis.Redis, settings: Settings
) -> Iterator[Callable[..., RunningFeeder]]:
    def start(**kw: Any) -> RunningFeeder:
        return RunningFeeder(make_feeder(sessions, redis_client, settings, **kw))

    yield start


def wait_status(
    client: TestClient,
    auth: dict[str, str],
    backfill_id: str,
    statuses: set[str],
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    until = time.monotonic() + timeout_s
    while True:
        resource: dict[str, Any] = client.get(f"/v1/backfills/{backfill_id}", headers=auth).json()
        if resource["status"] in statuses:
            return resource
        assert time.monotonic() < until, resource
        time.sleep(0.1)


def test_a_backfill_runs_every_line_once_and_returns_results_in_input_order(
    client: TestClient,
    auth: dict[str, str],
    sim_worker: Callable[..., RunningLoop],
    feeder: Callable[..., RunningFeeder],
    sessions: sessionmaker[Session],
) -> None:
    body = ndjson(1000)
    response = upload(client, auth, body)
    assert response.status_code == 202, response.text
    created = response.json()
    assert created["status"] == "in_progress"
    assert created["request_counts"] == {
        "total": 1000, "completed": 0, "failed": 0, "expired": 0, "cancelled": 0
    }  # fmt: skip
    assert created["input_bytes"] == len(body)
    assert response.headers["Location"] == f"/v1/backfills/{created['id']}"

    with sim_worker(), feeder() as running:
        done = wait_status(client, auth, created["id"], {"completed"})
    assert done["request_counts"]["completed"] == 1000
    assert done["finished_at"] is not None and done["eta_s"] is None
    # Never more in the bulk lane than the feeder's bound.
    assert 0 < running.max_live <= 300

    lines = client.get(f"/v1/backfills/{created['id']}/results", headers=auth).text.splitlines()
    results = [json.loads(line) for line in lines]
    assert [r["custom_id"] for r in results] == [f"row-{i}" for i in range(1000)]
    assert all(r["status"] == "succeeded" for r in results)
    assert [r["output"]["cost"] for r in results] == [1 + i % 4 for i in range(1000)]
    with sessions() as session:
        attempts = session.scalars(
            select(Job.attempts).where(Job.backfill_id == created["id"])
        ).all()
    assert sorted(set(attempts)) == [1]  # each ran once
    # The items do not bury the jobs submitted one by one.
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []
    items = client.get(
        "/v1/jobs", params={"backfill_id": created["id"], "limit": 5}, headers=auth
    ).json()["data"]
    assert len(items) == 5


def test_failed_items_are_counted_and_reported(
    client: TestClient,
    auth: dict[str, str],
    sim_worker: Callable[..., RunningLoop],
    feeder: Callable[..., RunningFeeder],
) -> None:
    body = ndjson(10) + ndjson(2, start=10, fail=True)
    created = upload(client, auth, body).json()
    with sim_worker(), feeder():
        done = wait_status(client, auth, created["id"], {"completed"})
    assert done["request_counts"]["completed"] == 10
    assert done["request_counts"]["failed"] == 2
    results = [
        json.loads(line)
        for line in client.get(f"/v1/backfills/{created['id']}/results", headers=auth).iter_lines()
    ]
    assert [r["status"] for r in results[-2:]] == ["failed", "failed"]
    assert "error" in results[-1] and "output" not in results[-1]


def test_partial_results_are_readable_while_it_runs(
    client: TestClient,
    auth: dict[str, str],
    sim_worker: Callable[..., RunningLoop],
    feeder: Callable[..., RunningFeeder],
) -> None:
    created = upload(client, auth, ndjson(300)).json()
    # Only the first chunk is fed, so the rest stays waiting.
    with sim_worker(), feeder(outstanding=100, chunk=100):
        until = time.monotonic() + 30
        while True:
            partial = client.get(f"/v1/backfills/{created['id']}/results", headers=auth).text
            count = len(partial.splitlines())
            if 0 < count < 300:
                break
            assert time.monotonic() < until and count < 300
            time.sleep(0.02)
        wait_status(client, auth, created["id"], {"completed"})
    ids = [json.loads(line)["custom_id"] for line in partial.splitlines()]
    assert ids == sorted(ids, key=lambda c: int(c.split("-")[1]))  # in input order


def test_cancel_stops_feeding_and_cancels_the_rest(
    client: TestClient,
    auth: dict[str, str],
    feeder: Callable[..., RunningFeeder],
    sessions: sessionmaker[Session],
) -> None:
    created = upload(client, auth, ndjson(500)).json()
    make = feeder(outstanding=100, chunk=100)
    make.feeder.step()  # one chunk queued; no worker runs it
    response = client.post(f"/v1/backfills/{created['id']}/cancel", headers=auth)
    assert response.status_code == 200
    assert response.json()["status"] == "cancelling"
    make.feeder.step()
    done = client.get(f"/v1/backfills/{created['id']}", headers=auth).json()
    assert done["status"] == "cancelled"
    assert done["request_counts"]["cancelled"] == 500
    with sessions() as session:
        statuses = session.execute(
            select(Job.status, func.count())
            .where(Job.backfill_id == created["id"])
            .group_by(Job.status)
        ).all()
    assert statuses == [("cancelled", 500)]
    again = client.post(f"/v1/backfills/{created['id']}/cancel", headers=auth)
    assert again.status_code == 200  # cancelling twice is not an error
    results = client.get(f"/v1/backfills/{created['id']}/results", headers=auth).text
    assert len(results.splitlines()) == 500


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (
            b'{"custom_id": "a", "input": {"cost": 1}}\n{"custom_id": "b", "input": ',
            422,
            "line 2: not valid JSON",
        ),
        (
            b'{"custom_id": "a", "input": {"cost": 1}}\n\n{"input": {"cost": 1}}\n',
            422,
            "line 3: custom_id: missing",
        ),
        (
            b'{"custom_id": "a", "input": {"cost": 1}}\n{"custom_id": "a", "input": {"cost": 2}}\n',
            422,
            "line 2: custom_id: 'a' is a duplicate of line 1",
        ),
        (b'{"custom_id": "a", "input": {"cost": "x"}}\n', 422, "line 1: input.cost"),
        (
            b'{"custom_id": "a", "input": {"cost": 1}, "extra": 1}\n',
            422,
            "line 1: unknown field(s): extra",
        ),
        (b"[1, 2]\n", 422, "line 1: must be a JSON object"),
        (b'{"custom_id": 7, "input": {"cost": 1}}\n', 422, "line 1: custom_id: must be"),
        (b'{"custom_id": "a", "input": {"cost": NaN}}\n', 422, "line 1: not valid JSON"),
        (b"\xff\xfe\n", 422, "line 1: not UTF-8"),
        (
            b'{"custom_id": "\\ud800", "input": {"cost": 1}}\n',
            422,
            "line 1: custom_id: must not contain unpaired surrogates",
        ),
        (b'{"custom_id": "a", "input": "\\u0000"}\n', 422, "line 1: input: must not contain NUL"),
        (b"", 422, "line 1: the file has no lines"),
        (b"\n\n  \n", 422, "the file has no lines"),
    ],
)
def test_bad_files_are_refused_with_the_line_and_leave_nothing(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    body: bytes,
    status: int,
    message: str,
) -> None:
    response = upload(client, auth, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    assert isinstance(error["line"], int)
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Backfill)) == 0
        assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_a_duplicate_across_chunks_names_both_lines(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    body = ndjson(4500) + json.dumps({"custom_id": "row-7", "input": {"cost": 1}}).encode()
    response = upload(client, auth, body)
    assert response.status_code == 422
    assert response.json()["error"]["message"] == (
        "line 4501: custom_id: 'row-7' is a duplicate of line 8"
    )
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_an_unknown_model_and_a_bad_callback_are_refused(
    client: TestClient, auth: dict[str, str]
) -> None:
    response = upload(client, auth, ndjson(1), model="nope")
    assert response.status_code == 422
    assert response.json()["error"]["message"].startswith("model: unknown model 'nope'")
    response = upload(client, auth, ndjson(1), callback_url="https://10.0.0.1/x")
    assert response.status_code == 422
    assert "callback_url: 10.0.0.1, a private address" in response.json()["error"]["message"]


def test_limits_on_lines_and_bytes(settings: Settings, auth: dict[str, str]) -> None:
    from api.app import create_app

    small = settings.model_copy(update={"backfill_max_lines": 10, "backfill_max_bytes": 4096})
    with TestClient(create_app(small)) as client:
        response = upload(client, auth, ndjson(11))
        assert response.status_code == 413
        assert response.json()["error"]["message"] == ("line 11: the file has more than 10 lines")
        # Announced too large: refused before a byte is read.
        response = upload(client, auth, b"x" * 5000)
        assert response.status_code == 413
        # Streamed (chunked, no Content-Length) past the limit: refused while reading.
        chunks = iter([ndjson(5)] * 20)
        response = client.post(
            "/v1/backfills", params={"model": "sim"}, content=chunks, headers=auth
        )
        assert response.status_code == 413, response.text
        assert "larger than 4096 bytes" in response.json()["error"]["message"]


def test_another_key_cannot_see_or_cancel_a_backfill(
    client: TestClient, auth: dict[str, str], make_token: Callable[[str], str]
) -> None:
    created = upload(client, auth, ndjson(3)).json()
    other = {"Authorization": f"Bearer {make_token('other')}"}
    for method, path in [
        ("GET", f"/v1/backfills/{created['id']}"),
        ("GET", f"/v1/backfills/{created['id']}/results"),
        ("POST", f"/v1/backfills/{created['id']}/cancel"),
    ]:
        response = client.request(method, path, headers=other)
        assert response.status_code == 404, (method, path)
    assert client.get("/v1/backfills", headers=other).json()["data"] == []
    assert client.get("/v1/backfills/not-an-id", headers=auth).status_code == 404
    refused = client.get("/v1/jobs", params={"backfill_id": "x\x00"}, headers=auth)
    assert refused.status_code == 422
    assert refused.json()["error"]["message"].startswith("backfill_id: not a backfill id")


def test_the_end_of_a_backfill_is_pushed_to_its_callback(
    settings: Settings,
    auth: dict[str, str],
    sim_worker: Callable[..., RunningLoop],
    feeder: Callable[..., RunningFeeder],
    sessions: sessionmaker[Session],
) -> None:
    from api.app import create_app
    from tests.webhook_receiver import Receiver, loopback_only
    from workers.tasks.webhooks import DeliveryConfig, WebhookSettings, attempt_delivery

    allowed = settings.model_copy(
        update={"webhook_allow_http": True, "webhook_allowed_networks": ["127.0.0.1/32"]}
    )
    with loopback_only(), TestClient(create_app(allowed)) as client:
        secret = client.get("/v1/webhook-secret", headers=auth).json()["secret"]
        with Receiver([secret]) as receiver:
            created = upload(client, auth, ndjson(50), callback_url=receiver.url).json()
            with sim_worker(), feeder():
                done = wait_status(client, auth, created["id"], {"completed"})
            with sessions() as session:
                (delivery_id,) = session.scalars(
                    select(WebhookDelivery.id).where(WebhookDelivery.backfill_id == created["id"])
                ).all()
            config = DeliveryConfig.of(allowed.section(WebhookSettings))
            assert attempt_delivery(sessions, delivery_id, config) == "delivered"
            (request,) = receiver.wait_for(1)
    assert request.verified
    assert request.body["type"] == "backfill.completed"
    assert request.body["data"]["id"] == created["id"]
    assert request.body["data"]["request_counts"] == done["request_counts"]
