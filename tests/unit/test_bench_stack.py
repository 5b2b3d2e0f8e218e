"""The smoke run's stacks: Celery's worker and beat only where a benchmark says it needs them."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config.settings import Settings
from ferry.up import metrics_ports
from harness.stack import SMOKE_ENV, FerryUp


def test_a_smoke_stack_that_needs_no_celery_starts_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SMOKE_ENV, "1")
    assert FerryUp(tmp_path, celery=False).env["FERRY_UP_CELERY"] == "0"
    assert "FERRY_UP_CELERY" not in FerryUp(tmp_path, celery=True).env
    # Flower is off there, and so are the events the workers send it.
    assert FerryUp(tmp_path).env["FERRY_WORKER_EVENTS"] == "false"


def test_a_full_run_stack_keeps_celery_whatever_the_benchmark_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SMOKE_ENV, "0")
    env = FerryUp(tmp_path, celery=False).env
    assert "FERRY_UP_CELERY" not in env
    assert "FERRY_WORKER_EVENTS" not in env


def test_without_celery_no_metrics_port_is_kept_for_its_worker() -> None:
    settings = Settings(models="sim", metrics_port_base=9500, up_celery=False)
    assert metrics_ports(settings, list) == {"worker-sim": 9500}
