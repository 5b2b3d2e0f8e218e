"""A worker's own port (/metrics, /healthz, /readyz), NVML's GPU figures, and the Flower
password and banner of `ferry up`."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import core.ops.metrics
from core.config.settings import Settings
from core.ops.health import serve
from core.ops.metrics import token_matches
from ferry.up import CRASH_LIMIT, RELOAD_LIMIT, Child, _banner, flower_password
from harness import webclient
from harness.ports import free_port
from workers.gpu.gpu_stats import register_gpu_metrics
from workers.gpu.versions import RESTART_EXIT_CODE


@pytest.fixture
def ready() -> threading.Event:
    return threading.Event()


@pytest.fixture
def port(ready: threading.Event) -> Iterator[int]:
    port = free_port()
    server = serve("127.0.0.1", port, ready.is_set)
    assert server is not None
    yield port
    server.shutdown()
    server.server_close()


def test_readyz_follows_the_worker_and_healthz_the_process(
    port: int, ready: threading.Event
) -> None:
    base = f"http://127.0.0.1:{port}"
    assert webclient.get(f"{base}/healthz").status_code == 200
    assert webclient.get(f"{base}/readyz").status_code == 503
    ready.set()
    assert webclient.get(f"{base}/readyz").status_code == 200
    ready.clear()  # stopping
    assert webclient.get(f"{base}/readyz").status_code == 503
    assert webclient.get(f"{base}/nothing").status_code == 404


def test_metrics_are_served_in_the_prometheus_format(port: int) -> None:
    assert core.ops.metrics.BATCH_SIZE  # registered in the default registry on import
    response = webclient.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert "ferry_batch_size" in names


def test_a_taken_port_is_logged_not_fatal(port: int) -> None:
    assert serve("127.0.0.1", port, lambda: True) is None


class FakeNvml:
    """NVML's calls as pynvml names them; which GPU was asked for is recorded."""

    def __init__(self, fail_on: str = "") -> None:
        self.fail_on = fail_on
        self.asked: list[str] = []

    def _maybe_fail(self, call: str) -> None:
        if call == self.fail_on:
            raise RuntimeError(f"NVMLError in {call}")

    def nvmlInit(self) -> None:
        self._maybe_fail("init")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        self._maybe_fail("handle")
        self.asked.append(uuid)
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        self._maybe_fail("read")
        return SimpleNamespace(gpu=37, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        self._maybe_fail("read")
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_gpu_utilisation_and_memory_come_from_nvml_at_each_scrape() -> None:
    registry = CollectorRegistry()
    nvml = FakeNvml()
    collector = register_gpu_metrics("minilm", "cuda:0", registry, nvml, uuid="GPU-abc")
    assert collector is not None
    assert nvml.asked == ["GPU-abc"]
    samples = _samples(registry)
    assert samples["ferry_gpu_utilization_ratio"] == pytest.approx(0.37)
    assert samples["ferry_gpu_memory_used_bytes"] == 3 * 2**30
    assert samples["ferry_gpu_memory_total_bytes"] == 80 * 2**30
    # A failing read skips one scrape; it never breaks /metrics.
    nvml.fail_on = "read"
    assert "ferry_gpu_utilization_ratio" not in _samples(registry)


@pytest.mark.parametrize("fail_on", ["init", "handle"])
def test_without_nvml_nothing_is_registered(fail_on: str) -> None:
    registry = CollectorRegistry()
    assert register_gpu_metrics("m", "cuda", registry, FakeNvml(fail_on), uuid="GPU-x") is None
    assert _samples(registry) == {}


def test_a_cpu_worker_has_no_gpu_metrics() -> None:
    registry = CollectorRegistry()
    assert register_gpu_metrics("m", "cpu", registry, FakeNvml(), uuid="GPU-x") is None


def test_the_flower_password_is_made_once_and_kept_private(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    first = flower_password(settings, tmp_path)
    assert len(first) >= 20
    assert (tmp_path / "flower-password").stat().st_mode & 0o077 == 0
    assert flower_password(settings, tmp_path) == first
    chosen = Settings(data_dir=tmp_path, flower_password="from-settings")
    assert flower_password(chosen, tmp_path) == "from-settings"


def test_the_banner_shows_where_flower_is_and_how_to_log_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings(flower_port=5599, flower_user="ops")
    _banner(settings, "http://127.0.0.1:8000", "redis://x", "fy_token", "pw123")
    out = capsys.readouterr().out
    assert "Flower    http://127.0.0.1:5599   (user ops, password pw123)" in out
    _banner(settings, "http://127.0.0.1:8000", "redis://x", "fy_token", None)
    assert "Flower" not in capsys.readouterr().out


def test_the_banner_shows_the_grpc_port_only_when_one_is_served(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _banner(Settings(grpc_port=8001), "http://127.0.0.1:8000", "redis://x", "fy_token", None)
    assert "gRPC      127.0.0.1:8001   (the inference protocol)" in capsys.readouterr().out
    _banner(Settings(), "http://127.0.0.1:8000", "redis://x", "fy_token", None)
    assert "gRPC" not in capsys.readouterr().out


def test_an_existing_password_file_is_kept_private(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    path = tmp_path / "flower-password"
    path.write_text("kept\n")
    path.chmod(0o644)
    assert flower_password(settings, tmp_path) == "kept"
    assert path.stat().st_mode & 0o077 == 0
    # An empty file left by a crash is replaced whole, private from the start.
    path.write_text("")
    made = flower_password(settings, tmp_path)
    assert made and path.read_text().strip() == made
    assert path.stat().st_mode & 0o077 == 0
    assert [p.name for p in tmp_path.iterdir()] == ["flower-password"]


@pytest.mark.parametrize("critical", [True, False])
def test_a_crash_loop_stops_the_stack_only_for_a_critical_child(critical: bool) -> None:
    child = Child("flower", [sys.executable, "-c", "raise SystemExit(3)"], critical=critical)
    env = dict(os.environ)
    now = 0.0
    child.start(env)
    results = []
    for _ in range(CRASH_LIMIT):
        assert child.process is not None
        child.process.wait()
        results.append(child.check(now, env))
        now += 9.0  # past the longest backoff before the fifth crash (8 s)
        child.check(now, env)  # restarts it
    assert results[:-1] == [True] * (CRASH_LIMIT - 1)
    assert results[-1] is (not critical)
    assert child.given_up is (not critical)
    if not critical:
        # Given up: it is not started again, and it never stops the stack.
        assert child.check(now + 100.0, env)
        assert child.process is not None and child.process.poll() is not None


def test_a_worker_restarting_for_another_version_is_started_again_at_once() -> None:
    # Exit code 76: the worker drained to load a model version alone. Not a crash,
    # unless it keeps asking: past RELOAD_LIMIT in a minute it backs off like one.
    child = Child("worker-m", [sys.executable, "-c", f"raise SystemExit({RESTART_EXIT_CODE})"])
    env = dict(os.environ)
    child.start(env)
    for _ in range(RELOAD_LIMIT):
        assert child.process is not None
        child.process.wait()
        assert child.check(0.0, env)  # the same instant: no backoff
        assert child.restart_at is None and not child.crashes
    assert child.process is not None
    child.process.wait()
    assert child.check(0.0, env)
    assert child.restart_at is not None and len(child.crashes) == 1  # backing off now


def test_with_a_token_metrics_ask_for_it_and_health_stays_open() -> None:
    port = free_port()
    server = serve("127.0.0.1", port, lambda: True, token="s3cret")
    assert server is not None
    try:
        base = f"http://127.0.0.1:{port}"
        assert webclient.get(f"{base}/metrics").status_code == 401
        wrong = webclient.get(f"{base}/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        right = webclient.get(f"{base}/metrics", headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200 and "ferry_" in right.text
        assert webclient.get(f"{base}/healthz").status_code == 200
        assert webclient.get(f"{base}/readyz").status_code == 200
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("expected", "header", "allowed"),
    [(None, None, True), ("s3cret", "Bearer s3cret", True), ("s3cret", "bearer s3cret", True),
     ("s3cret", "Bearer s3cré", False), ("s3cret", "Basic s3cret", False),
     ("s3cret", None, False), ("tøken", "Bearer tøken", True), ("tøken", "Bearer token", False)],
)  # fmt: skip
def test_the_token_comparison_takes_any_header(
    expected: str | None, header: str | None, allowed: bool
) -> None:
    assert token_matches(expected, header) is allowed
