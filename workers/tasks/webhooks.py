"""Sending webhook deliveries: one attempt at a time, each recorded.

:func:`attempt_delivery` is what the Celery task ``ferry.webhooks.deliver``
runs: it claims a due delivery (a conditional UPDATE, so two tasks for the same
delivery never both send), checks the URL against the SSRF guard, signs the
stored body with the key's secret (Standard Webhooks), POSTs it to the checked
address, and records the attempt and what comes next in one transaction.
:func:`dispatch_due` is what beat runs: it queues a task for every delivery
whose time has come.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import http.client
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from core.db.keys import signing_secrets
from core.db.schema import ApiKey, Job, WebhookAttempt, WebhookDelivery, utcnow
from core.db.webhooks import next_delay_s, parse_retry_after
from core.ops import tracing
from core.ops.urlguard import Resolver, Target, UrlPolicy, UrlRefused, check_url, system_resolver
from core.streams.target import REDIS_ERRORS
from workers.tasks.webhook_hosts import Entered, HostGate, receiver_of

log = logging.getLogger(__name__)

USER_AGENT = "Ferry-Webhooks/1"
ERROR_MAX_CHARS = 500


@dataclass(frozen=True)
class WebhookSettings:
    """The settings of a delivery attempt (``Settings.section``: FERRY_WEBHOOK_...)."""

    SETTINGS_PREFIX: ClassVar[str] = "webhook_"
    retry_schedule_s: list[float]
    retry_jitter: float
    timeout_s: float
    max_response_bytes: int
    allow_http: bool
    allowed_networks: list[str]
    lease_margin_s: float
    ca_file: Path | None


@dataclass(frozen=True)
class DeliveryConfig:
    schedule_s: tuple[float, ...]
    jitter: float
    timeout_s: float
    max_response_bytes: int
    policy: UrlPolicy
    # An attempt in flight owns its delivery for the timeout plus this; a Celery
    # worker that dies mid-attempt leaves it to be tried again after that.
    lease_margin_s: float = 30.0
    ssl_context: ssl.SSLContext | None = None  # None: the system's trust store

    @classmethod
    def of(cls, webhooks: WebhookSettings) -> DeliveryConfig:
        return cls(
            schedule_s=tuple(webhooks.retry_schedule_s),
            jitter=webhooks.retry_jitter,
            timeout_s=webhooks.timeout_s,
            max_response_bytes=webhooks.max_response_bytes,
            policy=UrlPolicy.of(webhooks.allow_http, webhooks.allowed_networks),
            lease_margin_s=webhooks.lease_margin_s,
            ssl_context=ssl.create_default_context(cafile=str(webhooks.ca_file))
            if webhooks.ca_file is not None
            else None,
        )


@dataclass(frozen=True)
class Response:
    status_code: int
    headers: dict[str, str]  # names lower-cased
    body: bytes  # at most max_response_bytes of it


class AttemptTimeout(TimeoutError):
    pass


@functools.cache
def system_trust() -> ssl.SSLContext:
    """The system's trust store, loaded once per process: loading it is milliseconds of
    CPU, which every HTTPS delivery would otherwise pay (a context is safe to share
    between the worker's threads). A changed store is read at the next start."""
    return ssl.create_default_context()


def post(
    target: Target,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    max_response_bytes: int,
    ssl_context: ssl.SSLContext | None = None,
) -> Response:
    """POST to one of the target's checked addresses; never resolves, never follows redirects.

    ``timeout_s`` bounds the whole attempt, connection to last byte: a receiver
    that trickles its answer is cut off when it runs out.
    """
    deadline = time.monotonic() + timeout_s
    sock = _connect(target, deadline)
    fired = threading.Event()

    def _abort() -> None:
        fired.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        if target.scheme == "https":
            context = ssl_context or system_trust()
            sock = context.wrap_socket(sock, server_hostname=target.host)
        connection = http.client.HTTPConnection(target.host, target.port)
        connection.sock = sock  # already connected to the address that was checked
        connection.putrequest("POST", target.path, skip_host=True, skip_accept_encoding=True)
        connection.putheader("Host", target.host_header)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.putheader("Connection", "close")
        connection.endheaders(body)
        response = connection.getresponse()
        data = response.read(max_response_bytes) if max_response_bytes else b""
        return Response(
            status_code=response.status,
            headers={k.lower(): v for k, v in response.getheaders()},
            body=data,
        )
    except (OSError, http.client.HTTPException) as exc:
        if fired.is_set() or isinstance(exc, TimeoutError):
            raise AttemptTimeout(f"no complete answer within {timeout_s:g} s") from exc
        raise
    finally:
        watchdog.cancel()
        sock.close()


def _connect(target: Target, deadline: float) -> socket.socket:
    error: OSError | None = None
    for address in target.addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(left)
        try:
            sock.connect((address, target.port))
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    if error is None or isinstance(error, TimeoutError):
        raise AttemptTimeout("could not connect in time")
    raise error


def signed_headers(
    delivery_id: str, body: str, secrets: list[str], now: dt.datetime
) -> dict[str, str]:
    """Standard Webhooks headers; one v1 signature per secret (two during a rotation)."""
    signatures = " ".join(Webhook(secret).sign(delivery_id, now, body) for secret in secrets)
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signatures,
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
    }


@dataclass(frozen=True)
class _Claimed:
    number: int
    step: int
    url: str
    payload: str
    secrets: list[str]
    job_id: str | None
    trace_context: str | None  # the job's request's traceparent (tracing on)


def traced(headers: dict[str, str], span: Any) -> dict[str, str]:
    """The headers with the delivery's traceparent (tracing on): a receiver may continue it."""
    tracing.inject(headers, span)
    return headers


def _due(now: dt.datetime) -> Any:
    return or_(
        and_(
            WebhookDelivery.status.in_(("pending", "retrying")),
            WebhookDelivery.next_attempt_at <= now,
        ),
        and_(WebhookDelivery.status == "delivering", WebhookDelivery.lease_until < now),
    )


def _unmarked(now: dt.datetime) -> Any:
    return or_(WebhookDelivery.queued_until.is_(None), WebhookDelivery.queued_until < now)


def _claim(
    sessions: sessionmaker[Session], delivery_id: str, now: dt.datetime, lease_s: float
) -> _Claimed | None:
    with sessions.begin() as session:
        before = session.execute(
            select(
                WebhookDelivery.status, WebhookDelivery.attempts, WebhookDelivery.lease_until
            ).where(WebhookDelivery.id == delivery_id)
        ).one_or_none()
        if before is None:
            return None
        # Conditional on what was read, so two senders can never both claim it.
        result = session.execute(
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == delivery_id,
                WebhookDelivery.attempts == before.attempts,
                _due(now),
            )
            .values(
                status="delivering",
                attempts=WebhookDelivery.attempts + 1,
                lease_until=now + dt.timedelta(seconds=lease_s),
                queued_until=None,
            )
        )
        if not result.rowcount:  # type: ignore[attr-defined]
            return None  # not due, already being sent, or finished
        if before.status == "delivering":
            # Its sender stopped mid-attempt (a killed Celery worker): the
            # receiver may or may not have had it. Recorded, then sent again.
            session.add(
                WebhookAttempt(
                    delivery_id=delivery_id,
                    number=before.attempts,
                    started_at=(before.lease_until or now) - dt.timedelta(seconds=lease_s),
                    duration_ms=None,
                    status_code=None,
                    error="abandoned: the sender stopped before the answer was recorded",
                )
            )
        delivery = session.get(WebhookDelivery, delivery_id)
        assert delivery is not None
        key = session.get(ApiKey, delivery.api_key_id)
        trace_context = None
        if delivery.job_id is not None and tracing.on():
            trace_context = session.scalar(
                select(Job.trace_context).where(Job.id == delivery.job_id)
            )
        return _Claimed(
            number=delivery.attempts,
            step=delivery.step,
            url=delivery.url,
            payload=delivery.payload,
            secrets=signing_secrets(key, now) if key is not None else [],
            job_id=delivery.job_id,
            trace_context=trace_context,
        )


def _in_attempt(delivery_id: str, number: int) -> Any:
    """The delivery, still in the attempt this sender claimed (its lease not taken over)."""
    return and_(
        WebhookDelivery.id == delivery_id,
        WebhookDelivery.status == "delivering",
        WebhookDelivery.attempts == number,
    )


def _put_back(
    sessions: sessionmaker[Session], delivery_id: str, claimed: _Claimed, due_at: dt.datetime
) -> None:
    """Undo a claim whose attempt was not made: due again at ``due_at``, no attempt counted."""
    with sessions.begin() as session:
        session.execute(
            update(WebhookDelivery)
            .where(_in_attempt(delivery_id, claimed.number))
            .values(
                status="pending" if claimed.number == 1 else "retrying",
                attempts=claimed.number - 1,
                next_attempt_at=due_at,
                lease_until=None,
                queued_until=None,
            )
        )


def _enter(gate: HostGate | None, receiver: str) -> Entered | None:
    """The gate's answer; None (go, unguarded) without a gate or while Redis cannot say."""
    if gate is None:
        return None
    try:
        return gate.enter(receiver)
    except REDIS_ERRORS as exc:
        log.warning("the receivers' gate is unreachable", extra={"error_type": type(exc).__name__})
        return None


def attempt_delivery(
    sessions: sessionmaker[Session],
    delivery_id: str,
    config: DeliveryConfig,
    *,
    resolve: Resolver = system_resolver,
    clock: Callable[[], dt.datetime] = utcnow,
    unit: Callable[[], float] = random.random,
    ssl_context: ssl.SSLContext | None = None,
    gate: HostGate | None = None,
) -> str | None:
    """One attempt if the delivery is due; returns its status after it (None: nothing done,
    or not now: ``gate`` held its receiver back, and it is due again later)."""
    started_at = clock()
    claimed = _claim(sessions, delivery_id, started_at, config.timeout_s + config.lease_margin_s)
    if claimed is None:
        return None
    receiver = receiver_of(claimed.url)
    entered = _enter(gate, receiver)
    if entered is not None and entered.token is None:
        assert entered.retry_at_s is not None
        _put_back(
            sessions, delivery_id, claimed, dt.datetime.fromtimestamp(entered.retry_at_s, dt.UTC)
        )
        log.info(
            "webhook attempt held back",
            extra={
                "delivery_id": delivery_id,
                "job_id": claimed.job_id,
                "why": "receiver held off" if entered.held else "receiver busy",
            },
        )
        return None
    status_code: int | None = None
    error: str | None = None
    retry_after_s: float | None = None
    final = False
    silent = False  # timed out: the receiver held the attempt's slot and did not answer
    began = time.perf_counter()
    span = tracing.start_span(
        "ferry.webhook.deliver",
        parent=claimed.trace_context,
        kind=SpanKind.CLIENT,
        attributes={"ferry.delivery_id": delivery_id, "ferry.attempt": claimed.number},
    )
    try:
        if not claimed.secrets:
            raise UrlRefused("the API key has no signing secret")
        target = check_url(claimed.url, config.policy, resolve)
        response = post(
            target,
            claimed.payload.encode(),
            traced(signed_headers(delivery_id, claimed.payload, claimed.secrets, clock()), span),
            config.timeout_s,
            config.max_response_bytes,
            ssl_context or config.ssl_context,
        )
        status_code = response.status_code
        if 300 <= status_code < 400:
            location = response.headers.get("location", "")[:200]
            error = f"redirect not followed (HTTP {status_code} to {location or 'nowhere'})"
        elif status_code == 410:
            error = "HTTP 410 Gone: the receiver asked for no more deliveries"
            final = True
        elif not 200 <= status_code < 300:
            error = f"HTTP {status_code}"
            retry_after_s = parse_retry_after(response.headers.get("retry-after"), clock())
    except UrlRefused as exc:
        error = f"refused: {exc.reason}"
        final = exc.permanent  # an address we may not call will not become one we may
    except AttemptTimeout as exc:
        error = f"timed out: {exc}"
        silent = True
    except (OSError, http.client.HTTPException) as exc:
        # Refused or reset at once: it held no slot for long, so it puts no hold on.
        error = f"connection failed: {type(exc).__name__}: {exc}"[:ERROR_MAX_CHARS]
    except Exception as exc:
        # Recorded like any failure, so a bug cannot leave the delivery
        # re-sent on every lease expiry without a trace.
        log.exception("webhook attempt failed unexpectedly", extra={"delivery_id": delivery_id})
        error = f"internal error ({type(exc).__name__})"
    if gate is not None and entered is not None and entered.token is not None:
        outcome = "answered" if status_code is not None else "silent" if silent else "other"
        try:
            if gate.leave(receiver, entered.token, outcome):
                log.warning(
                    "a webhook receiver stopped answering; held off",
                    extra={"delivery_id": delivery_id, "hold_s": gate.hold_s},
                )
        except REDIS_ERRORS as exc:
            log.warning(
                "the receivers' gate is unreachable", extra={"error_type": type(exc).__name__}
            )
    duration_ms = round((time.perf_counter() - began) * 1000.0, 2)
    if span is not None:
        if status_code is not None:
            span.set_attribute("http.response.status_code", status_code)
        if error is not None:
            span.set_status(StatusCode.ERROR, error)
        span.end()

    ended_at = clock()
    delay_s = None
    if error is None:
        status = "delivered"
    elif final:
        status = "failed"
    else:
        delay_s = next_delay_s(
            config.schedule_s, claimed.step + 1, retry_after_s, config.jitter, unit()
        )
        status = "failed" if delay_s is None else "retrying"
    with sessions.begin() as session:
        session.add(
            WebhookAttempt(
                delivery_id=delivery_id,
                number=claimed.number,
                started_at=started_at,
                duration_ms=duration_ms,
                status_code=status_code,
                error=error,
            )
        )
        session.execute(
            update(WebhookDelivery)
            .where(_in_attempt(delivery_id, claimed.number))
            .values(
                status=status,
                step=claimed.step + 1 if status == "retrying" else claimed.step,
                next_attempt_at=ended_at + dt.timedelta(seconds=delay_s)
                if delay_s is not None
                else None,
                lease_until=None,
                queued_until=None,
                last_status_code=status_code,
                last_error=error,
                finished_at=ended_at if status in ("delivered", "failed") else None,
            )
        )
    log.info(
        "webhook attempt",
        extra={
            "delivery_id": delivery_id,
            "job_id": claimed.job_id,
            "attempt": claimed.number,
            "status_code": status_code,
            "outcome": status,
            "duration_ms": duration_ms,
            "retry_in_s": round(delay_s, 3) if delay_s is not None else None,
        },
    )
    return status


def dispatch_due(
    sessions: sessionmaker[Session],
    send: Callable[[str], object],
    now: dt.datetime,
    hold_s: float,
    limit: int = 1000,
) -> int:
    """Queue an attempt for every due delivery; returns how many were queued.

    A queued delivery is not queued again for ``hold_s`` (its task may be
    waiting behind others), so a backlog does not multiply.
    """
    with sessions.begin() as session:
        ids = list(
            session.scalars(
                select(WebhookDelivery.id)
                .where(_due(now), _unmarked(now))
                .order_by(WebhookDelivery.next_attempt_at)
                .limit(limit)
            )
        )
        # Marked before the tasks exist, and only while still due and unmarked
        # (re-checked by the UPDATE itself): a concurrent dispatch whose
        # delivery was meanwhile attempted must not hold its next retry back.
        if ids:
            session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id.in_(ids), _due(now), _unmarked(now))
                .values(queued_until=now + dt.timedelta(seconds=hold_s))
            )
    sent = 0
    try:
        for delivery_id in ids:
            send(delivery_id)
            sent += 1
    finally:
        if sent < len(ids):  # the broker is down: leave the rest for the next run
            with sessions.begin() as session:
                session.execute(
                    update(WebhookDelivery)
                    .where(WebhookDelivery.id.in_(ids[sent:]))
                    .values(queued_until=None)
                )
    return sent
