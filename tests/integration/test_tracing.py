"""A job's trace, end to end, into a real OTLP/HTTP receiver on loopback: the API in uvicorn,
a real sim worker, a real Redis and database, and a webhook delivered to a real receiver."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Job, WebhookDelivery, utcnow
from core.ops import tracing
from harness import webclient
from harness.served import served
from harness.threads import ServingThread
from tests.integration.conftest import RunningLoop, build_sim_loop
from tests.webhook_receiver import Receiver
from workers.tasks.webhooks import DeliveryConfig, WebhookSettings, attempt_delivery, dispatch_due

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


@dataclass(frozen=True)
class Got:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    links: list[tuple[str, str]]
    attributes: dict[str, Any]
    service: str


class Collector(ServingThread):
    """An OTLP/HTTP trace receiver (protobuf), as a collector would run it."""

    def __init__(self) -> None:
        self.spans: list[Got] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = ExportTraceServiceRequest.FromString(body)
                got = []
                for resource_spans in request.resource_spans:
                    service = next(
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    )
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            got.append(
                                Got(
                                    name=span.name,
                                    trace_id=span.trace_id.hex(),
                                    span_id=span.span_id.hex(),
                                    parent_id=span.parent_span_id.hex(),
                                    kind=span.kind,
                                    links=[(k.trace_id.hex(), k.span_id.hex()) for k in span.links],
                                    attributes={
                                        a.key: a.value.string_value or a.value.int_value
                                        for a in span.attributes
                                    },
                                    service=service,
                                )
                            )
                with collector.lock:
                    collector.spans += got
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        super().__init__(ThreadingHTTPServer(("127.0.0.1", 0), Handler))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def named(self, name: str) -> list[Got]:
        with self.lock:
            return [span for span in self.spans if span.name == name]


@pytest.fixture
def collector() -> Iterator[Collector]:
    with Collector() as running:
        assert tracing.setup("test", {"OTEL_EXPORTER_OTLP_ENDPOINT": running.endpoint})
        try:
            yield running
        finally:
            tracing.shutdown()  # off again for the tests after this one


def test_off_unless_the_environment_asks() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert not tracing.wanted({**on, "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({**on, "OTEL_TRACES_EXPORTER": "none"})
    assert tracing.endpoint(on) == "http://127.0.0.1:4318/v1/traces"
    assert not tracing.setup("test", {}) and not tracing.on()
    assert tracing.traceparent() is None and tracing.start_span("x") is None


def test_a_jobs_trace_runs_from_its_request_to_its_webhook(
    collector: Collector, settings: Settings, token: str, sessions: sessionmaker[Session]
) -> None:
    hooks = settings.model_copy(
        update={
            "webhook_allow_http": True,
            "webhook_allowed_networks": ["127.0.0.1/32"],
            "webhook_timeout_s": 5.0,
        }
    )
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with served(hooks) as api:
        headers = {"Authorization": f"Bearer {token}"}
        secret = webclient.get(f"{api.base}/v1/webhook-secret", headers=headers).json()["secret"]
        with Receiver([secret]) as receiver, RunningLoop(build_sim_loop(hooks, "traced")):
            answer = webclient.post(
                f"{api.base}/v1/jobs?wait=10",
                json={"model": "sim", "input": {"cost": 3}, "callback_url": receiver.url},
                headers={**headers, "traceparent": f"00-{client_trace}-{client_span}-01"},
            )
            assert answer.status_code == 200, answer.text
            job_id = answer.json()["id"]
            config = DeliveryConfig.of(hooks.section(WebhookSettings))
            until = time.monotonic() + 20
            while not receiver.requests:  # as beat and a Celery worker would
                dispatch_due(
                    sessions, lambda d: attempt_delivery(sessions, d, config), utcnow(), 0.0
                )
                assert time.monotonic() < until, "the webhook was not delivered"
                time.sleep(0.1)
            (hook,) = receiver.wait_for(1)
    tracing.shutdown()  # sends what is buffered

    with sessions() as session:
        stored = session.scalar(select(Job.trace_context).where(Job.id == job_id))
        delivered = session.scalar(
            select(WebhookDelivery.status).where(WebhookDelivery.job_id == job_id)
        )
    assert delivered == "delivered"
    (server,) = collector.named("POST /v1/jobs")
    # The client's trace goes on: the request is its child.
    assert (server.trace_id, server.parent_id) == (client_trace, client_span)
    assert server.kind == 2 and server.service == "ferry-test"  # SPAN_KIND_SERVER
    assert server.attributes["http.route"] == "/v1/jobs"
    assert stored == f"00-{client_trace}-{server.span_id}-01"

    def one(name: str) -> Got:
        (found,) = [s for s in collector.named(name) if s.trace_id == client_trace]
        return found

    enqueue, wait, run = one("ferry.enqueue"), one("ferry.queue_wait"), one("ferry.run")
    assert enqueue.parent_id == wait.parent_id == run.parent_id == server.span_id
    assert enqueue.attributes["ferry.job_id"] == run.attributes["ferry.job_id"] == job_id
    assert one("ferry.result_write").parent_id == run.span_id
    deliver = one("ferry.webhook.deliver")
    assert deliver.parent_id == server.span_id and deliver.kind == 3  # SPAN_KIND_CLIENT
    # The receiver can go on with the trace too: the delivery's span is its parent.
    assert hook.headers["traceparent"] == f"00-{client_trace}-{deliver.span_id}-01"

    # The batch is a trace of its own, linked to the job's; the job's run links back.
    batch_id = run.attributes["ferry.batch_id"]
    (batch,) = [
        s for s in collector.named("ferry.batch") if s.attributes["ferry.batch_id"] == batch_id
    ]
    assert batch.trace_id != client_trace and batch.parent_id == ""
    assert (client_trace, server.span_id) in batch.links
    assert run.links == [(batch.trace_id, batch.span_id)]
    stages = {
        name: [s for s in collector.named(f"ferry.{name}") if s.parent_id == batch.span_id]
        for name in ("prepare", "record", "acknowledge")
    }
    assert {name: len(found) for name, found in stages.items()} == dict.fromkeys(stages, 1)


def test_a_batch_links_to_the_trace_of_every_job_it_ran(
    collector: Collector, settings: Settings, token: str
) -> None:
    """Jobs of several traces queued before the worker starts share its batches: each
    batch links to every job it ran, and no other, and each job's run links back."""
    contexts: dict[str, str] = {}  # job id -> its client's trace
    with served(settings) as api:
        headers = {"Authorization": f"Bearer {token}"}
        for _ in range(6):
            trace = secrets.token_hex(16)
            answer = webclient.post(
                f"{api.base}/v1/jobs",
                json={"model": "sim", "input": {"cost": 1}},
                headers={**headers, "traceparent": f"00-{trace}-{secrets.token_hex(8)}-01"},
            )
            assert answer.status_code == 202, answer.text
            contexts[answer.json()["id"]] = trace
        with RunningLoop(build_sim_loop(settings, "traced-batch")):
            for job_id in contexts:
                done = webclient.get(f"{api.base}/v1/jobs/{job_id}?wait=10", headers=headers)
                assert done.json()["status"] == "succeeded", done.text
    tracing.shutdown()  # sends what is buffered

    servers = {s.trace_id: s for s in collector.named("POST /v1/jobs")}
    runs = {s.attributes["ferry.job_id"]: s for s in collector.named("ferry.run")}
    assert set(runs) == set(contexts)
    batches = {s.attributes["ferry.batch_id"]: s for s in collector.named("ferry.batch")}
    ran: dict[str, set[tuple[str, str]]] = {}
    for job_id, trace in contexts.items():
        run = runs[job_id]
        assert run.trace_id == trace and run.parent_id == servers[trace].span_id
        batch = batches[run.attributes["ferry.batch_id"]]
        assert run.links == [(batch.trace_id, batch.span_id)]
        ran.setdefault(run.attributes["ferry.batch_id"], set()).add((trace, servers[trace].span_id))
    for batch_id, jobs in ran.items():
        assert set(batches[batch_id].links) == jobs
    # Queued before the worker started, they cannot all have run alone.
    assert max(len(jobs) for jobs in ran.values()) > 1, ran
