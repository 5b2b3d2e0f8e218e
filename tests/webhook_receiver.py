"""A real webhook receiver on 127.0.0.1, and a guard that keeps tests off the network.

The receiver verifies every request with the ``standardwebhooks`` package, as
a client of Ferry would, and de-duplicates on ``webhook-id``. Its answers are
scripted: a list of actions played in order, the last one repeated.
"""

from __future__ import annotations

import datetime as dt
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from standardwebhooks import Webhook, WebhookVerificationError

from harness.threads import ServingThread
from tests.e2e.netguard.sitecustomize import patch

# A stack's settings for deliveries to a Receiver: plain HTTP to loopback allowed (the
# SSRF guard refuses both by default), and retries at the schedule's times, with no jitter.
LOOPBACK_WEBHOOKS = {
    "FERRY_WEBHOOK_ALLOW_HTTP": "true",
    "FERRY_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.0/8"]',
    "FERRY_WEBHOOK_RETRY_JITTER": "0",
}


@dataclass(frozen=True)
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Received:
    webhook_id: str
    timestamp: int
    signature: str
    body: dict[str, Any]
    verified: bool
    received_at: float
    status: int  # what the receiver answered
    host: str = ""  # the Host header
    headers: dict[str, str] = field(default_factory=dict)  # every header, names lower-cased


class Receiver(ServingThread):
    def __init__(
        self,
        secrets: list[str],
        script: list[Answer] | None = None,
        tls: ssl.SSLContext | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.secrets = secrets
        self.tls = tls
        self.host = host
        self.script = list(script or [Answer()])
        self.requests: list[Received] = []
        self.seen: set[str] = set()  # webhook-ids processed (the receiver's de-duplication)
        self.processed: list[dict[str, Any]] = []  # events acted on once each
        self.lock = threading.Lock()
        server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        server.daemon_threads = True
        if tls is not None:
            server.socket = tls.wrap_socket(server.socket, server_side=True)
        super().__init__(server)

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.server.server_address[1]}/hooks/ferry"

    def wait_for(self, count: int, timeout_s: float = 20.0) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.requests) >= count:
                    return list(self.requests)
            time.sleep(0.05)
        raise AssertionError(f"expected {count} requests, got {len(self.requests)}")

    def _answer(self, number: int) -> Answer:
        return self.script[min(number, len(self.script) - 1)]

    def _verify(self, raw: bytes, headers: dict[str, str]) -> bool:
        for secret in self.secrets:
            try:
                Webhook(secret).verify(raw, headers)
                return True
            except WebhookVerificationError:
                continue
        return False

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                headers = {k.lower(): v for k, v in self.headers.items()}
                verified = receiver._verify(raw, headers)
                with receiver.lock:
                    answer = receiver._answer(len(receiver.requests))
                    webhook_id = headers.get("webhook-id", "")
                    receiver.requests.append(
                        Received(
                            webhook_id=webhook_id,
                            timestamp=int(headers.get("webhook-timestamp", "0")),
                            signature=headers.get("webhook-signature", ""),
                            body=json.loads(raw),
                            verified=verified,
                            received_at=time.time(),
                            status=answer.status,
                            host=headers.get("host", ""),
                            headers=headers,
                        )
                    )
                    if verified and 200 <= answer.status < 300 and webhook_id not in receiver.seen:
                        receiver.seen.add(webhook_id)
                        receiver.processed.append(json.loads(raw))
                if answer.delay_s:
                    time.sleep(answer.delay_s)
                try:
                    self.send_response(answer.status if verified else 401)
                    for name, value in answer.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the sender gave up waiting (the timeout test)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def make_tls(directory: Path, names: list[str]) -> tuple[ssl.SSLContext, Path]:
    """A private CA and a server certificate for ``names``: (server context, CA file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def build(subject: str, issuer: x509.Name | None, key: Any, sign_key: Any, ca: bool) -> Any:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer or name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                              content_commitment=False, key_encipherment=False,
                              data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )  # fmt: skip
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
            ).add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(sign_key.public_key()),
                critical=False,
            )
        return builder.sign(sign_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = build("Ferry test CA", None, ca_key, ca_key, ca=True)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = build(names[0], ca_cert.subject, leaf_key, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(ca_cert.public_bytes(pem))
    chain = directory / "server.pem"
    chain.write_bytes(
        leaf.public_bytes(pem)
        + leaf_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(chain)
    return server, ca_file


class NetworkEscape(AssertionError):
    pass


@contextmanager
def loopback_only() -> Iterator[list[str]]:
    """Any TCP/UDP connection to an address other than loopback raises.

    A bug in the SSRF guard then fails the test instead of sending a packet.
    Yields the list of refused destinations, for assertions.
    """
    refused: list[str] = []

    def refuse(host: str) -> None:
        refused.append(host)
        raise NetworkEscape(f"test tried to connect to {host}")

    undo = patch(refuse)
    try:
        yield refused
    finally:
        undo()


def fake_resolver(names: dict[str, list[str]]) -> Callable[[str, int], list[str]]:
    from core.ops.urlguard import ResolutionError

    def resolve(host: str, _port: int) -> list[str]:
        if host not in names:
            raise ResolutionError(f"{host} does not resolve (test resolver)", temporary=False)
        return names[host]

    return resolve
