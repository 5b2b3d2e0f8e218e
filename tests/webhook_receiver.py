"""A real webhook receiver on 127.0.0.1, and a guard that keeps tests off the network.

The receiver verifies every request with the ``standardwebhooks`` package, as
a client of Ferry would, and de-duplicates on ``webhook-id``. Its answers are
scripted: a list of actions played in order, the last one repeated.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks import Webhook, WebhookVerificationError


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


class Receiver:
    def __init__(self, secrets: list[str], script: list[Answer] | None = None) -> None:
        self.secrets = secrets
        self.script = list(script or [Answer()])
        self.requests: list[Received] = []
        self.seen: set[str] = set()  # webhook-ids processed (the receiver's de-duplication)
        self.processed: list[dict[str, Any]] = []  # events acted on once each
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/ferry"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

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


class NetworkEscape(AssertionError):
    pass


@contextmanager
def loopback_only() -> Iterator[list[str]]:
    """Any TCP/UDP connection to an address other than loopback raises.

    A bug in the SSRF guard then fails the test instead of sending a packet.
    Yields the list of refused destinations, for assertions.
    """
    refused: list[str] = []
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        host = str(address[0]).split("%", 1)[0]
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False  # a name: Ferry's sender never connects to one
        if not loopback:
            refused.append(host)
            raise NetworkEscape(f"test tried to connect to {host}")

    def connect(sock: socket.socket, address: Any) -> None:
        check(sock, address)
        original_connect(sock, address)

    def connect_ex(sock: socket.socket, address: Any) -> int:
        check(sock, address)
        return original_connect_ex(sock, address)

    socket.socket.connect = connect  # type: ignore[method-assign,assignment]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign,assignment]
    try:
        yield refused
    finally:
        socket.socket.connect = original_connect  # type: ignore[method-assign]
        socket.socket.connect_ex = original_connect_ex  # type: ignore[method-assign]


def fake_resolver(names: dict[str, list[str]]) -> Callable[[str, int], list[str]]:
    from core.urlguard import ResolutionError

    def resolve(host: str, _port: int) -> list[str]:
        if host not in names:
            raise ResolutionError(f"{host} does not resolve (test resolver)", temporary=False)
        return names[host]

    return resolve
