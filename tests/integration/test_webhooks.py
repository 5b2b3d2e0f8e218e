"""Webhook deliveries against a real receiver on 127.0.0.1, real Redis and real databases.

The API and a sim worker run as in production; deliveries are driven by the
same functions the Celery tasks call (``dispatch_due`` then
``attempt_delivery``), with a compressed schedule. The end-to-end test in
``tests/e2e`` runs them through Celery and beat under ``ferry up``.
Every test here runs inside :func:`loopback_only`: a connection anywhere but
127.0.0.1 fails the test.
"""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.db.schema import WebhookDelivery, utcnow
from core.ops.urlguard import Target
from tests.integration.conftest import RunningLoop
from tests.webhook_receiver import (
    Answer,
    NetworkEscape,
    Receiver,
    fake_resolver,
    loopback_only,
    make_tls,
)
from workers.tasks.webhooks import (
    AttemptTimeout,
    DeliveryConfig,
    WebhookSettings,
    _claim,
    attempt_delivery,
    dispatch_due,
    post,
)

SCHEDULE_S = [0.0, 0.2, 0.2, 0.2]  # four attempts, compressed
NAMES = {"hooks.partner.test": ["127.0.0.1"], "intranet.partner.test": ["10.1.2.3"]}


@pytest.fixture(autouse=True)
def no_network() -> Iterator[list[str]]:
    with loopback_only() as refused:
        yield refused


@pytest.fixture
def hook_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "webhook_allow_http": True,
            "webhook_allowed_networks": ["127.0.0.1/32"],
            "webhook_retry_schedule_s": SCHEDULE_S,
            "webhook_retry_jitter": 0.0,
            "webhook_timeout_s": 1.0,
        }
    )


@pytest.fixture
def resolver() -> dict[str, list[str]]:
    return dict(NAMES)  # a test may change an answer, as DNS can


@pytest.fixture
def api(hook_settings: Settings, resolver: dict[str, list[str]]) -> Iterator[TestClient]:
    with TestClient(create_app(hook_settings, resolve=fake_resolver(resolver))) as test_client:
        yield test_client


@pytest.fixture
def secret(api: TestClient, auth: dict[str, str]) -> str:
    response = api.get("/v1/webhook-secret", headers=auth)
    assert response.status_code == 200, response.text
    value: str = response.json()["secret"]
    assert value.startswith("whsec_")
    return value


Drive = Callable[..., list[WebhookDelivery]]


@pytest.fixture
def drive(
    sessions: sessionmaker[Session], hook_settings: Settings, resolver: dict[str, list[str]]
) -> Drive:
    """Run due deliveries as beat and the Celery worker would, until none is open."""

    def run(timeout_s: float = 20.0, **overrides: Any) -> list[WebhookDelivery]:
        webhooks = hook_settings.model_copy(update=overrides).section(WebhookSettings)
        config = DeliveryConfig.of(webhooks)
        resolve = fake_resolver(resolver)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dispatch_due(
                sessions,
                lambda delivery_id: attempt_delivery(
                    sessions, delivery_id, config, resolve=resolve
                ),
                utcnow(),
                hold_s=60.0,
            )
            with sessions() as session:
                rows = list(session.scalars(select(WebhookDelivery)))
            if rows and all(row.status in ("delivered", "failed") for row in rows):
                return rows
            time.sleep(0.05)
        raise AssertionError("deliveries still open")

    return run


@dataclass
class Hooks:
    """The handles most tests here use: the API with a key, the sim worker, the
    delivery driver and the database."""

    api: TestClient
    auth: dict[str, str]
    sim_worker: Callable[..., RunningLoop]
    drive: Drive
    sessions: sessionmaker[Session]
    settings: Settings
    resolver: dict[str, list[str]]

    def run_job(self, callback_url: str, **body: Any) -> dict[str, Any]:
        """Submit a sim job with ``callback_url`` and run a worker until it ends."""
        body.setdefault("input", {"cost": 1})
        response = self.api.post(
            "/v1/jobs",
            json={"model": "sim", "callback_url": callback_url, **body},
            headers=self.auth,
        )
        assert response.status_code == 202, response.text
        assert response.json()["callback"]["status"] == "pending"
        with self.sim_worker():
            job: dict[str, Any] = self.api.get(
                f"/v1/jobs/{response.json()['id']}?wait=10", headers=self.auth
            ).json()
        return job

    def job(self, job_id: str) -> dict[str, Any]:
        shown: dict[str, Any] = self.api.get(f"/v1/jobs/{job_id}", headers=self.auth).json()
        return shown

    def deliveries(self, job_id: str) -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = self.api.get(
            f"/v1/jobs/{job_id}/deliveries", headers=self.auth
        ).json()["data"]
        return listed

    def delivery_id(self) -> str:
        """The one delivery's id (the test made one)."""
        with self.sessions() as session:
            (delivery_id,) = session.scalars(select(WebhookDelivery.id)).all()
        return delivery_id


@pytest.fixture
def hooks(
    api: TestClient,
    auth: dict[str, str],
    sim_worker: Callable[..., RunningLoop],
    drive: Drive,
    sessions: sessionmaker[Session],
    hook_settings: Settings,
    resolver: dict[str, list[str]],
) -> Hooks:
    return Hooks(api, auth, sim_worker, drive, sessions, hook_settings, resolver)


def test_a_receiver_that_fails_three_times_gets_it_on_the_fourth_with_one_webhook_id(
    hooks: Hooks,
    secret: str,
) -> None:
    script = [Answer(500), Answer(500), Answer(500), Answer(200)]
    with Receiver([secret], script) as receiver:
        job = hooks.run_job(receiver.url)
        assert job["status"] == "succeeded"
        (delivery,) = hooks.drive()
        requests = receiver.wait_for(4)

    assert delivery.status == "delivered"
    assert [r.status for r in requests] == [500, 500, 500, 200]
    assert all(r.verified for r in requests)
    assert {r.webhook_id for r in requests} == {delivery.id}
    assert delivery.id.startswith("msg_")
    # The receiver acted once; the body is the job resource as it ended.
    assert len(receiver.processed) == 1
    event = receiver.processed[0]
    assert event["type"] == "job.succeeded"
    assert event["data"]["id"] == job["id"]
    assert event["data"]["output"] == job["output"]
    # Fresh timestamps: each is the moment of its attempt, not of the event.
    for request in requests:
        assert abs(request.received_at - request.timestamp) < 2.0

    shown = hooks.job(job["id"])["callback"]
    assert shown == {
        "url": receiver.url,
        "status": "delivered",
        "attempts": 4,
        "last_status_code": 200,
        "last_error": None,
        "next_attempt_at": None,
    }
    listed = hooks.deliveries(job["id"])
    assert len(listed) == 1
    assert listed[0]["id"] == delivery.id
    assert listed[0]["type"] == "job.succeeded"
    log = listed[0]["attempt_log"]
    assert [a["number"] for a in log] == [1, 2, 3, 4]
    assert [a["status_code"] for a in log] == [500, 500, 500, 200]
    assert [a["error"] for a in log] == ["HTTP 500", "HTTP 500", "HTTP 500", None]
    assert all(a["duration_ms"] is not None and a["duration_ms"] >= 0 for a in log)


def test_a_receiver_down_for_the_whole_schedule_fails_the_delivery_not_the_job(
    hooks: Hooks,
) -> None:
    with Receiver([]) as receiver:
        url = receiver.url  # closed when the block ends: nothing listens there
    job = hooks.run_job(url)
    (delivery,) = hooks.drive()

    assert delivery.status == "failed"
    assert delivery.attempts == len(SCHEDULE_S)
    (listed,) = hooks.deliveries(job["id"])
    assert len(listed["attempt_log"]) == len(SCHEDULE_S)
    for attempt in listed["attempt_log"]:
        assert attempt["status_code"] is None
        assert attempt["error"].startswith("connection failed: ConnectionRefusedError")
    again = hooks.job(job["id"])
    assert again["status"] == "succeeded"
    assert again["output"] == job["output"]
    assert again["callback"]["status"] == "failed"
    assert again["callback"]["attempts"] == len(SCHEDULE_S)


def test_410_gone_stops_at_once(
    hooks: Hooks,
    secret: str,
) -> None:
    with Receiver([secret], [Answer(410)]) as receiver:
        job = hooks.run_job(receiver.url)
        (delivery,) = hooks.drive()
        assert len(receiver.requests) == 1
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("failed", 1, 410)
    assert delivery.last_error is not None and "410" in delivery.last_error
    assert hooks.job(job["id"])["callback"]["status"] == "failed"


def test_a_slow_receiver_is_cut_off_at_the_timeout_and_retried(
    hooks: Hooks,
    secret: str,
) -> None:
    with Receiver([secret], [Answer(200, delay_s=3.0), Answer(200)]) as receiver:
        job = hooks.run_job(receiver.url)
        (delivery,) = hooks.drive(webhook_timeout_s=0.5)
        requests = receiver.wait_for(2)
    assert delivery.status == "delivered"
    assert requests[0].webhook_id == requests[1].webhook_id
    (log,) = hooks.deliveries(job["id"])
    first, second = log["attempt_log"]
    assert first["error"].startswith("timed out")
    assert first["status_code"] is None
    assert 400 <= first["duration_ms"] < 2500  # cut at 0.5 s, not after the 3 s answer
    assert second["status_code"] == 200


def test_retry_after_is_honoured(
    hooks: Hooks,
    secret: str,
) -> None:
    script = [Answer(503, {"Retry-After": "1"}), Answer(200)]
    with Receiver([secret], script) as receiver:
        hooks.run_job(receiver.url)
        hooks.drive(webhook_retry_schedule_s=[0.0, 0.05, 5.0])
        first, second = receiver.wait_for(2)
    # The schedule said 0.05 s; the receiver asked for 1 s.
    assert second.received_at - first.received_at >= 0.95


@pytest.mark.parametrize(
    ("body", "event"),
    [
        ({"input": {"cost": 1, "fail": True}}, "job.failed"),
        ({"deadline_ms": 1}, "job.expired"),
    ],
)
def test_failed_and_expired_jobs_are_delivered_too(
    hooks: Hooks,
    secret: str,
    body: dict[str, Any],
    event: str,
) -> None:
    with Receiver([secret]) as receiver:
        job = hooks.run_job(receiver.url, **body)
        assert f"job.{job['status']}" == event
        (delivery,) = hooks.drive()
        (request,) = receiver.wait_for(1)
    assert delivery.status == "delivered"
    assert request.verified
    assert request.body["type"] == event
    assert request.body["data"]["status"] == job["status"]
    assert request.body["data"]["error"] == job["error"]


def test_a_cancelled_job_is_delivered_and_can_be_redelivered_with_the_same_id(
    hooks: Hooks, secret: str
) -> None:
    api, auth = hooks.api, hooks.auth
    with Receiver([secret]) as receiver:
        response = api.post(
            "/v1/jobs",
            json={"model": "sim", "input": {"cost": 1}, "callback_url": receiver.url},
            headers=auth,
        )
        job_id = response.json()["id"]
        assert api.delete(f"/v1/jobs/{job_id}", headers=auth).status_code == 200
        hooks.drive()
        redelivered = api.post(f"/v1/jobs/{job_id}/deliveries/redeliver", headers=auth)
        assert redelivered.status_code == 202, redelivered.text
        assert redelivered.json()["status"] == "pending"
        (delivery,) = hooks.drive()
        first, second = receiver.wait_for(2)

    assert first.body["type"] == "job.cancelled"
    assert first.webhook_id == second.webhook_id == delivery.id
    assert first.body == second.body
    assert len(receiver.processed) == 1  # the receiver's de-duplication saw one event
    assert delivery.attempts == 2
    (log,) = hooks.deliveries(job_id)
    assert [a["number"] for a in log["attempt_log"]] == [1, 2]


def test_redelivery_needs_a_finished_job_with_a_callback(
    api: TestClient, auth: dict[str, str]
) -> None:
    plain = api.post("/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=auth)
    response = api.post(f"/v1/jobs/{plain.json()['id']}/deliveries/redeliver", headers=auth)
    assert response.status_code == 409
    assert "no callback_url" in response.json()["error"]["message"]

    queued = api.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 1}, "callback_url": "http://127.0.0.1:9/x"},
        headers=auth,
    )
    response = api.post(f"/v1/jobs/{queued.json()['id']}/deliveries/redeliver", headers=auth)
    assert response.status_code == 409
    assert "is queued" in response.json()["error"]["message"]


def test_another_key_sees_no_deliveries(
    api: TestClient,
    auth: dict[str, str],
    make_token: Callable[[str], str],
) -> None:
    response = api.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 1}, "callback_url": "http://127.0.0.1:9/x"},
        headers=auth,
    )
    job_id = response.json()["id"]
    api.delete(f"/v1/jobs/{job_id}", headers=auth)
    other = {"Authorization": f"Bearer {make_token('other')}"}
    assert api.get(f"/v1/jobs/{job_id}/deliveries", headers=other).status_code == 404
    assert api.post(f"/v1/jobs/{job_id}/deliveries/redeliver", headers=other).status_code == 404
    assert api.get(f"/v1/jobs/{job_id}/deliveries", headers=auth).status_code == 200


def test_a_rotated_secret_signs_beside_the_old_one_during_the_grace(
    hooks: Hooks,
    secret: str,
) -> None:
    api, auth = hooks.api, hooks.auth
    rotated = api.post("/v1/webhook-secret/rotate", headers=auth).json()
    assert rotated["secret"].startswith("whsec_") and rotated["secret"] != secret
    assert rotated["previous_secret_valid_until"] is not None
    assert api.get("/v1/webhook-secret", headers=auth).json()["secret"] == rotated["secret"]

    with Receiver([secret]) as old_only, Receiver([rotated["secret"]]) as new_only:
        hooks.run_job(old_only.url)
        hooks.run_job(new_only.url)
        hooks.drive()
        (old,) = old_only.wait_for(1)
        (new,) = new_only.wait_for(1)
    assert old.verified and new.verified
    assert len(old.signature.split(" ")) == 2  # v1,<new> v1,<old>


def test_a_name_that_resolves_to_a_private_address_later_fails_with_the_reason(
    hooks: Hooks,
    secret: str,
    no_network: list[str],
) -> None:
    with Receiver([secret]) as receiver:
        url = receiver.url.replace("127.0.0.1", "hooks.partner.test")
        job = hooks.run_job(url)
        hooks.resolver["hooks.partner.test"] = ["10.9.8.7"]  # DNS rebinding after the check
        (delivery,) = hooks.drive()
        assert receiver.requests == []
    assert delivery.status == "failed"
    assert delivery.attempts == 1  # an address Ferry may not call is not retried
    assert delivery.last_error == (
        "refused: hooks.partner.test resolves to 10.9.8.7, a private address"
    )
    assert no_network == []  # refused before any connection was tried
    callback = hooks.job(job["id"])["callback"]
    assert callback["status"] == "failed"
    assert "10.9.8.7" in callback["last_error"]


def test_a_redirect_is_not_followed(
    hooks: Hooks,
    secret: str,
    no_network: list[str],
) -> None:
    script = [Answer(302, {"Location": "http://10.0.0.1/internal"})]
    with Receiver([secret], script) as receiver:
        job = hooks.run_job(receiver.url)
        (delivery,) = hooks.drive()
        assert len(receiver.requests) == len(SCHEDULE_S)
    assert delivery.status == "failed"
    assert delivery.last_error == "redirect not followed (HTTP 302 to http://10.0.0.1/internal)"
    assert no_network == []
    assert hooks.job(job["id"])["status"] == "succeeded"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1:8080/hook", "only https URLs are allowed"),
        ("http://169.254.169.254/latest/meta-data/", "only https URLs are allowed"),
        ("https://169.254.169.254/latest/meta-data/", "a cloud metadata address"),
        ("https://10.0.0.1/hook", "10.0.0.1, a private address"),
        ("https://[::1]/hook", "::1, a loopback address"),
        ("https://[::ffff:10.0.0.1]/hook", "carries 10.0.0.1, a private address"),
        ("https://intranet.partner.test/hook", "resolves to 10.1.2.3, a private address"),
        ("https://nowhere.partner.test/hook", "nowhere.partner.test does not resolve"),
        ("ftp://hooks.partner.test/hook", "callback_url"),
        ("file:///etc/passwd", "callback_url"),
    ],
)
def test_callback_urls_ferry_would_never_call_are_refused_at_submission(
    settings: Settings,
    auth: dict[str, str],
    url: str,
    reason: str,
) -> None:
    # The default policy: https only, no allow-list.
    with TestClient(create_app(settings, resolve=fake_resolver(NAMES))) as api:
        response = api.post(
            "/v1/jobs",
            json={"model": "sim", "input": {"cost": 1}, "callback_url": url},
            headers=auth,
        )
        assert response.status_code == 422, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("callback_url")
        assert reason in message
        assert api.get("/v1/jobs", headers=auth).json()["data"] == []


def test_the_allow_list_admits_loopback_for_http(api: TestClient, auth: dict[str, str]) -> None:
    response = api.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 1}, "callback_url": "http://127.0.0.1:9/x"},
        headers=auth,
    )
    assert response.status_code == 202, response.text
    refused = api.post(
        "/v1/jobs",
        json={"model": "sim", "input": {"cost": 1}, "callback_url": "http://10.0.0.1/x"},
        headers=auth,
    )
    assert refused.status_code == 422
    assert "10.0.0.1, a private address" in refused.json()["error"]["message"]


def test_the_delivery_row_is_committed_with_the_outcome(hooks: Hooks) -> None:
    job = hooks.run_job("http://127.0.0.1:9/x")
    with hooks.sessions() as session:
        (delivery,) = session.scalars(select(WebhookDelivery)).all()
    assert delivery.job_id == job["id"]
    assert (delivery.status, delivery.attempts, delivery.event_type) == (
        "pending",
        0,
        "job.succeeded",
    )
    assert delivery.next_attempt_at is not None
    assert delivery.next_attempt_at <= utcnow()


def test_the_network_guard_itself_stops_a_connection_elsewhere(no_network: list[str]) -> None:
    with pytest.raises(NetworkEscape):
        socket.create_connection(("10.255.255.1", 80), timeout=0.1)
    assert no_network == ["10.255.255.1"]


class RawServer:
    """Accepts one connection and plays ``reply`` to it, ``pause_s`` between chunks."""

    def __init__(self, reply: list[bytes], pause_s: float) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.reply = reply
        self.pause_s = pause_s
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65536)
            try:
                for chunk in self.reply:
                    conn.sendall(chunk)
                    time.sleep(self.pause_s)
            except OSError:
                pass  # the sender hung up, as it should
        self.listener.close()


def _target(port: int) -> Target:
    return Target(
        url=f"http://127.0.0.1:{port}/", scheme="http", host="127.0.0.1", port=port, path="/",
        addresses=("127.0.0.1",),
    )  # fmt: skip


def test_a_receiver_that_trickles_its_answer_is_cut_at_the_whole_attempt_timeout() -> None:
    # One byte every 0.1 s: each read succeeds, only the attempt's deadline stops it.
    server = RawServer([bytes([b]) for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100], 0.1)
    began = time.monotonic()
    with pytest.raises(AttemptTimeout):
        post(_target(server.port), b"{}", {}, timeout_s=0.6, max_response_bytes=1024)
    assert time.monotonic() - began < 2.0


def test_only_the_first_bytes_of_a_large_answer_are_read() -> None:
    body = b"x" * 5_000_000
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    server = RawServer([head, body], 0.0)
    response = post(_target(server.port), b"{}", {}, timeout_s=5, max_response_bytes=100)
    assert response.status_code == 200
    assert response.body == b"x" * 100


def test_an_attempt_whose_sender_died_is_recorded_and_made_again_after_its_lease(
    hooks: Hooks, secret: str
) -> None:
    sessions = hooks.sessions
    config = DeliveryConfig.of(hooks.settings.section(WebhookSettings))
    with Receiver([secret]) as receiver:
        job = hooks.run_job(receiver.url)
        delivery_id = hooks.delivery_id()
        # A sender claims the delivery, then dies before it sends or records anything.
        assert _claim(sessions, delivery_id, utcnow(), lease_s=30.0) is not None
        assert attempt_delivery(sessions, delivery_id, config) is None  # its lease holds
        later = utcnow() + dt.timedelta(seconds=31)
        assert attempt_delivery(sessions, delivery_id, config, clock=lambda: later) == "delivered"
        (request,) = receiver.wait_for(1)
    assert request.verified and request.webhook_id == delivery_id
    (log,) = hooks.deliveries(job["id"])
    abandoned, delivered = log["attempt_log"]
    assert abandoned["number"] == 1 and abandoned["duration_ms"] is None
    assert abandoned["error"].startswith("abandoned")
    assert (delivered["number"], delivered["status_code"]) == (2, 200)


@pytest.mark.parametrize(
    ("certificate_for", "outcome"),
    [("hooks.partner.test", "delivered"), ("someone-else.test", "retrying")],
)
def test_https_goes_to_the_checked_address_with_the_name_for_tls_and_host(
    hooks: Hooks,
    secret: str,
    tmp_path: Path,
    certificate_for: str,
    outcome: str,
) -> None:
    """The name resolves (to 127.0.0.1, allowed); the connection goes to that address, and
    TLS verifies the certificate against the URL's name, not the address."""
    server_tls, ca_file = make_tls(tmp_path, [certificate_for])
    private_ca = hooks.settings.model_copy(update={"webhook_ca_file": ca_file})
    config = DeliveryConfig.of(private_ca.section(WebhookSettings))
    with Receiver([secret], tls=server_tls, host="hooks.partner.test") as receiver:
        job = hooks.run_job(receiver.url)
        delivery_id = hooks.delivery_id()
        resolve = fake_resolver(hooks.resolver)
        status = attempt_delivery(hooks.sessions, delivery_id, config, resolve=resolve)
        requests = list(receiver.requests)
    assert status == outcome
    with hooks.sessions() as session:
        delivery = session.get(WebhookDelivery, delivery_id)
        assert delivery is not None
    if outcome == "delivered":
        (request,) = requests
        assert request.verified
        assert request.host == f"hooks.partner.test:{receiver.server.server_address[1]}"
        assert request.body["data"]["id"] == job["id"]
    else:
        assert requests == []
        assert delivery.last_error is not None
        assert "SSLCertVerificationError" in delivery.last_error


def test_a_generation_sends_started_progress_and_terminal_webhooks_when_asked(
    hook_settings: Settings,
    tmp_path: Path,
    auth: dict[str, str],
    resolver: dict[str, list[str]],
    drive: Drive,
) -> None:
    from tests.integration.generation_worker import (
        MODEL,
        generation_settings,
        slow_steps,
        start_worker,
    )

    gen = generation_settings(hook_settings, tmp_path / "gen", eos=False).model_copy(
        update={"progress_every_s": 0.5}
    )
    with TestClient(create_app(gen, resolve=fake_resolver(resolver))) as api:
        secret = api.get("/v1/webhook-secret", headers=auth).json()["secret"]
        with Receiver([secret]) as receiver:
            every = {"prompt": "tell me", "max_tokens": 120, "temperature": 0}
            asked = api.post(
                "/v1/jobs",
                json={"model": MODEL, "input": every, "callback_url": receiver.url,
                      "callback_events": ["started", "progress", "terminal"]},
                headers=auth,
            )  # fmt: skip
            plain = api.post(
                "/v1/jobs",
                json={"model": MODEL, "input": every, "callback_url": receiver.url},
                headers=auth,
            )
            assert asked.status_code == plain.status_code == 202, (asked.text, plain.text)
            running = start_worker(gen)
            slow_steps(running, 0.02)  # 120 steps of at least 20 ms: progress every 0.5 s
            with running:
                for job_id in (asked.json()["id"], plain.json()["id"]):
                    ends = time.monotonic() + 60
                    while api.get(f"/v1/jobs/{job_id}?wait=5", headers=auth).json()["status"] in (
                        "queued",
                        "running",
                    ):
                        assert time.monotonic() < ends, "the generation did not end"
            rows = drive()
            receiver.wait_for(len(rows))
            listed = api.get(f"/v1/jobs/{asked.json()['id']}/deliveries", headers=auth).json()
            shown = api.get(f"/v1/jobs/{asked.json()['id']}", headers=auth).json()["callback"]
    assert all(row.status == "delivered" for row in rows)
    events = sorted(receiver.processed, key=lambda e: e["timestamp"])
    mine = [e for e in events if e["data"]["id"] == asked.json()["id"]]
    others = [e for e in events if e["data"]["id"] == plain.json()["id"]]
    assert [e["type"] for e in others] == ["job.succeeded"]  # by default, the terminal one
    kinds = [e["type"] for e in mine]
    assert kinds[0] == "job.started" and kinds.count("job.started") == 1
    assert mine[0]["data"]["attempt"] == 1
    progress = [e["data"] for e in mine if e["type"] == "job.progress"]
    assert len(progress) >= 2, kinds
    tokens = [p["tokens"] for p in progress]
    assert tokens == sorted(tokens) and tokens[0] > 0 and tokens[-1] <= 120
    assert {p["max_tokens"] for p in progress} == {120}
    assert kinds.count("job.succeeded") == 1
    # Every event signed and in the job's deliveries; its callback is the terminal one's.
    assert all(r.verified for r in receiver.requests)
    assert sorted(d["type"] for d in listed["data"]) == sorted(kinds)
    assert shown["status"] == "delivered"


def test_callback_events_are_checked_before_anything_is_stored(
    hook_settings: Settings,
    tmp_path: Path,
    auth: dict[str, str],
    resolver: dict[str, list[str]],
) -> None:
    from tests.integration.generation_worker import MODEL, generation_settings

    gen = generation_settings(hook_settings, tmp_path / "gen", beside=("sim",))
    url = "http://127.0.0.1:9/hooks"
    cases = [
        ({"model": "sim", "input": {"cost": 1}, "callback_url": url,
          "callback_events": ["started", "terminal"]},
         "callback_events: started apply to generation jobs only"),
        ({"model": MODEL, "input": {"prompt": "x"}, "callback_events": ["progress"]},
         "needs a callback_url"),
        ({"model": MODEL, "input": {"prompt": "x"}, "callback_url": url,
          "callback_events": ["terminal", "terminal"]},
         "must not name an event twice"),
        ({"model": MODEL, "input": {"prompt": "x"}, "callback_url": url,
          "callback_events": ["finished"]},
         "callback_events"),
        ({"model": MODEL, "input": {"prompt": "x"}, "callback_url": url, "callback_events": []},
         "callback_events"),
    ]  # fmt: skip
    with TestClient(create_app(gen, resolve=fake_resolver(resolver))) as api:
        for body, why in cases:
            response = api.post("/v1/jobs", json=body, headers=auth)
            assert response.status_code == 422, (body, response.text)
            assert why in response.text, (why, response.text)
        assert api.get("/v1/jobs", headers=auth).json()["data"] == []


class Silent:
    """A receiver that accepts every connection and never answers (a hung server, or a
    middlebox that swallows the request); it counts the connections open at once."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.held: list[socket.socket] = []
        self.open_at_once = 0
        self.accepted = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/hooks/silent"

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                self.accepted += 1
                self.held = [c for c in self.held if _still_open(c)] + [connection]
                self.open_at_once = max(self.open_at_once, len(self.held))

    def __enter__(self) -> Silent:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.close()
        for connection in self.held:
            connection.close()


def _still_open(connection: socket.socket) -> bool:
    """Whether the sender still holds the connection (it closes it when it gives up): what
    it sent is read and dropped until nothing is left (open) or the end (closed)."""
    connection.setblocking(False)
    try:
        while connection.recv(65536):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_a_receiver_that_never_answers_is_held_off_and_holds_up_no_other(
    hooks: Hooks, secret: str, redis_url: str, key_prefix: str
) -> None:
    import redis as redis_client

    from workers.tasks.webhook_hosts import HostGate, receiver_of

    gate = HostGate(
        redis_client.Redis.from_url(redis_url, decode_responses=True), key_prefix,
        concurrency=1, failures=2, hold_s=60.0, lease_s=5.0,
    )  # fmt: skip
    api, auth, sessions = hooks.api, hooks.auth, hooks.sessions
    webhooks = hooks.settings.model_copy(update={"webhook_timeout_s": 0.5}).section(WebhookSettings)
    config = DeliveryConfig.of(webhooks)
    resolve = fake_resolver(hooks.resolver)
    with Silent() as silent, Receiver([secret]) as good:
        with hooks.sim_worker():
            for url in [silent.url] * 8 + [good.url] * 8:
                response = api.post(
                    "/v1/jobs", json={"model": "sim", "input": {"cost": 1}, "callback_url": url},
                    headers=auth,
                )  # fmt: skip
                assert response.status_code == 202, response.text
            ends = time.monotonic() + 30
            while api.get("/v1/jobs?status=queued", headers=auth).json()["data"]:
                assert time.monotonic() < ends, "jobs still queued"
                time.sleep(0.05)
        with sessions() as session:
            ids = {d.id: d.url for d in session.scalars(select(WebhookDelivery))}
        held_key = gate._keys(receiver_of(silent.url))[1]
        gauge = redis_client.Redis.from_url(redis_url)
        # Two Celery slots; beat's dispatch every 50 ms, until the silent receiver is held
        # off and the other one has every webhook.
        with ThreadPoolExecutor(2) as slots:
            ends = time.monotonic() + 30
            while not (gauge.exists(held_key) and len(good.processed) == 8):
                assert time.monotonic() < ends, (silent.accepted, len(good.processed))
                dispatch_due(
                    sessions,
                    lambda i: slots.submit(
                        attempt_delivery, sessions, i, config, resolve=resolve, gate=gate
                    ),
                    utcnow(),
                    hold_s=0.2,
                )
                time.sleep(0.05)
            # Those put back while it was busy come due again, and wait for the hold to end.
            time.sleep(1.1)
            dispatch_due(
                sessions,
                lambda i: attempt_delivery(sessions, i, config, resolve=resolve, gate=gate),
                utcnow(),
                hold_s=0.2,
            )
        with sessions() as session:
            rows = {d.id: d for d in session.scalars(select(WebhookDelivery))}
    order = list(ids)
    mine = [rows[i] for i in order if ids[i] == silent.url]
    others = [rows[i] for i in order if ids[i] == good.url]
    # The other receiver got every webhook, on the first attempt, in the same pass.
    assert all(d.status == "delivered" and d.attempts == 1 for d in others)
    # The silent one took one slot at a time, and two attempts in a row timed out before it
    # was held off: its other deliveries were put back without counting an attempt.
    assert silent.open_at_once == 1 and silent.accepted == 2, silent.accepted
    assert sum(d.attempts for d in mine) == 2
    assert all(d.status in ("retrying", "pending") for d in mine)
    due = [d.next_attempt_at for d in mine if d.next_attempt_at]
    assert len(due) == 8 and min(due) >= utcnow() + dt.timedelta(seconds=50)  # the hold's end
    redis_client.Redis.from_url(redis_url).delete(
        *gate._keys(receiver_of(silent.url))  # this test's receiver only
    )
