"""A network guard: any TCP or UDP connection to an address other than loopback raises.

Loaded by every Python process of a test's `ferry up` (through PYTHONPATH):
there, each refused connection is also written to the file named by
FERRY_TEST_NETGUARD_LOG, so a test can assert that nothing Ferry did reached
beyond 127.0.0.1, even from a Celery worker whose errors would otherwise only
be recorded as a failed attempt. The test process itself uses :func:`patch`
(through ``tests.webhook_receiver.loopback_only``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from typing import Any


def _beyond_loopback(sock: socket.socket, address: Any) -> str | None:
    """The destination host if this connection would leave loopback (None: it would not)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    host = str(address[0]).split("%", 1)[0]
    try:
        return None if ipaddress.ip_address(host).is_loopback else host
    except ValueError:
        return host  # a name: Ferry's sender never connects to one


def patch(refuse: Callable[[str], None]) -> Callable[[], None]:
    """Make ``socket.connect`` call ``refuse(host)`` (which raises) beyond loopback.

    Returns what undoes it.
    """
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded_connect(sock: socket.socket, address: Any) -> None:
        host = _beyond_loopback(sock, address)
        if host is not None:
            refuse(host)
        connect(sock, address)

    def guarded_connect_ex(sock: socket.socket, address: Any) -> int:
        host = _beyond_loopback(sock, address)
        if host is not None:
            refuse(host)
        return connect_ex(sock, address)

    socket.socket.connect = guarded_connect  # type: ignore[method-assign,assignment]
    socket.socket.connect_ex = guarded_connect_ex  # type: ignore[method-assign,assignment]

    def undo() -> None:
        socket.socket.connect = connect  # type: ignore[method-assign]
        socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]

    return undo


def _log_and_refuse(host: str) -> None:
    with open(os.environ["FERRY_TEST_NETGUARD_LOG"], "a") as log:
        log.write(f"{os.getpid()} {host}\n")
    raise ConnectionRefusedError(f"network guard: {host} is not loopback")


if os.environ.get("FERRY_TEST_NETGUARD_LOG"):
    patch(_log_and_refuse)
