"""The smoke run's stacks: Celery's worker and beat only where a benchmark says it needs them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import results
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


def test_a_stack_setting_from_the_command_line_is_a_ferry_name_and_a_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser(prog="bench")
    results.add_set_option(parser, "the stack")
    args = parser.parse_args(["--set", "FERRY_A=1", "--set", "FERRY_B=x=y"])
    assert dict(args.set) == {"FERRY_A": "1", "FERRY_B": "x=y"}
    for wrong in ("FERRY_A", "PATH=/bin"):
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args(["--set", wrong])
        assert stopped.value.code == 2
        assert f"--set takes FERRY_NAME=VALUE, not {wrong!r}" in capsys.readouterr().err
