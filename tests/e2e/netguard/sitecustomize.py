"""Loaded by every Python process of a test's `ferry up` (through PYTHONPATH).

Any TCP or UDP connection to an address other than loopback raises, and is
written to the file named by FERRY_TEST_NETGUARD_LOG, so a test can assert
that nothing Ferry did reached beyond 127.0.0.1, even from a Celery worker
whose errors would otherwise only be recorded as a failed attempt.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

_LOG = os.environ.get("FERRY_TEST_NETGUARD_LOG")
_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex


def _check(sock: socket.socket, address: Any) -> None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    host = str(address[0]).split("%", 1)[0]
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        if _LOG:
            with open(_LOG, "a") as log:
                log.write(f"{os.getpid()} {host}\n")
        raise ConnectionRefusedError(f"network guard: {host} is not loopback")


def _guarded_connect(sock: socket.socket, address: Any) -> None:
    _check(sock, address)
    _connect(sock, address)


def _guarded_connect_ex(sock: socket.socket, address: Any) -> int:
    _check(sock, address)
    return _connect_ex(sock, address)


if _LOG:
    socket.socket.connect = _guarded_connect  # type: ignore[method-assign,assignment]
    socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign,assignment]
