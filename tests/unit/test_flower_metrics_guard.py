"""Flower's /metrics behind credentials: the metrics token when set, else Flower's login."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import tornado.httpserver
import tornado.web
from flower.views.monitor import Metrics

from ferry.cli import guard_flower_metrics
from harness import webclient
from harness.ports import free_port


class FlowerLike(tornado.web.Application):
    """What Flower's Metrics handler reads from its application."""

    def __init__(self) -> None:
        super().__init__([(r"/metrics", Metrics)])
        self.options = SimpleNamespace(basic_auth=["ferry:secret"], auth=None, url_prefix="")

    def purge_offline_worker_metrics(self) -> None:
        pass


@pytest.fixture
def served() -> Iterator[str]:
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        server = tornado.httpserver.HTTPServer(FlowerLike())
        server.listen(port, "127.0.0.1")
        started.set()
        loop.run_forever()
        server.stop()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(5)
    yield f"http://127.0.0.1:{port}/metrics"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    # Leave Flower's handler as it was for the other tests.
    Metrics.get = Metrics._ferry_unguarded


def test_with_a_token_only_the_bearer_token_is_let_in(served: str) -> None:
    guard_flower_metrics("tok3n")
    assert webclient.get(served).status_code == 401
    assert webclient.get(served, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert webclient.get(served, auth=("ferry", "secret")).status_code == 401
    page = webclient.get(served, headers={"Authorization": "Bearer tok3n"})
    assert page.status_code == 200 and "python_info" in page.text


def test_without_a_token_flowers_own_login_is_asked_for(served: str) -> None:
    guard_flower_metrics(None)
    guard_flower_metrics(None)  # twice: still one check, not a check of a check
    assert webclient.get(served).status_code == 401
    assert webclient.get(served, auth=("ferry", "wrong")).status_code == 401
    basic = base64.b64encode(b"ferry:secret").decode()
    assert webclient.get(served, headers={"Authorization": f"Basic {basic}"}).status_code == 200
