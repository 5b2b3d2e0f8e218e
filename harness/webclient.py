"""HTTP from tests, the harness and the benchmarks: one TLS context for every client.

An httpx client made with its default ``verify=True`` loads certifi's bundle of
CA certificates into a new SSL context: about 25 ms of CPU, even when every URL
it is given is plain http on the loopback. ``httpx.get`` makes such a client at
every call, so a readiness probe polling every 0.1 s spent more CPU than the
process it waited for, and the suite, bound by its CPU on two cores, paid for it
everywhere. The clients made here share one context, made once per process
(an ``ssl.SSLContext`` may be shared between threads).
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def tls() -> ssl.SSLContext:
    """httpx's default context (certifi's CA bundle), made once."""
    return httpx.create_ssl_context()


def client(**kwargs: Any) -> httpx.Client:
    """``httpx.Client(**kwargs)`` with the shared context."""
    return httpx.Client(verify=tls(), **kwargs)


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.request``: one request on a client of its own, with the shared context."""
    with client() as one:
        return one.request(method, url, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)


def put(url: str, **kwargs: Any) -> httpx.Response:
    return request("PUT", url, **kwargs)


def delete(url: str, **kwargs: Any) -> httpx.Response:
    return request("DELETE", url, **kwargs)
