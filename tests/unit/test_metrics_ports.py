"""Which workers `ferry up` starts, on which GPU, and the /metrics port of each process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from core.config.settings import Settings
from ferry.up import metrics_ports, visible_gpus, worker_plan


def no_gpu() -> list[str]:
    return []


def test_consecutive_ports_in_model_order_then_the_celery_worker() -> None:
    settings = Settings(models="minilm,sim", metrics_port_base=9500)
    assert metrics_ports(settings, no_gpu) == {
        "worker-minilm": 9500,
        "worker-sim": 9501,
        "celery-worker": 9502,
    }


def test_base_zero_serves_no_metrics() -> None:
    assert metrics_ports(Settings(metrics_port_base=0)) == {}


def test_one_worker_per_visible_gpu_for_a_device_model_and_one_for_sim() -> None:
    settings = Settings(models="minilm,sim", metrics_port_base=9500)
    plan = worker_plan(settings, lambda: ["0", "1"])
    assert plan == [
        ("worker-minilm-gpu0", "minilm", "0"),
        ("worker-minilm-gpu1", "minilm", "1"),
        ("worker-sim", "sim", None),
    ]
    assert list(metrics_ports(settings, lambda: ["0", "1"])) == [
        "worker-minilm-gpu0", "worker-minilm-gpu1", "worker-sim", "celery-worker",
    ]  # fmt: skip


def test_listed_mig_slices_get_a_worker_each_and_none_means_one_on_ferry_device() -> None:
    slices = "MIG-4b1c7e1a-0000-5000-8000-000000000001,MIG-4b1c7e1a-0000-5000-8000-000000000002"
    plan = worker_plan(Settings(models="minilm", gpus=slices), no_gpu)
    assert [gpu for _name, _model, gpu in plan] == slices.split(",")
    assert worker_plan(Settings(models="minilm", gpus="none"), lambda: ["0"]) == [
        ("worker-minilm", "minilm", None)
    ]


def test_without_a_gpu_auto_starts_one_worker_per_model() -> None:
    assert worker_plan(Settings(models="minilm,sim"), no_gpu) == [
        ("worker-minilm", "minilm", None),
        ("worker-sim", "sim", None),
    ]


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []  # hidden on purpose: CPU workers


def test_a_bad_gpu_list_is_refused() -> None:
    with pytest.raises(ValueError, match="gpus"):
        Settings(gpus="0;rm -rf /")


def test_workers_on_different_slices_have_different_consumer_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workers.gpu.main import default_consumer_name

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-a")
    first = default_consumer_name("minilm", "cuda:0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-b")
    assert default_consumer_name("minilm", "cuda:0") != first
    assert default_consumer_name("minilm", "cpu").endswith(":minilm:cpu")


def test_several_workers_of_a_model_on_one_device_have_names_of_their_own(
    tmp_path: Path,
) -> None:
    from core.models.reader import load_repository
    from ferry.up import instance_of
    from tests.models import REPOSITORY
    from workers.gpu.main import default_consumer_name

    shutil.copytree(REPOSITORY / "sim", tmp_path / "sim")
    toml = (tmp_path / "sim" / "model.toml").read_text()
    two_sims = toml.replace('device = "none"', 'device = "none"\ncount = 2')
    (tmp_path / "sim" / "model.toml").write_text(two_sims)
    (tmp_path / "minilm").mkdir()
    shutil.copytree(REPOSITORY / "minilm", tmp_path / "minilm", dirs_exist_ok=True)
    minilm = (tmp_path / "minilm" / "model.toml").read_text()
    (tmp_path / "minilm" / "model.toml").write_text(minilm + "\n[instances]\ncount = 2\n")
    settings = Settings(models="minilm,sim", model_repository=tmp_path)
    repository = load_repository(tmp_path, environ={})
    plan = worker_plan(settings, lambda: ["0", "1"], repository)
    assert plan == [
        ("worker-minilm-gpu0#1", "minilm", "0"), ("worker-minilm-gpu0#2", "minilm", "0"),
        ("worker-minilm-gpu1#1", "minilm", "1"), ("worker-minilm-gpu1#2", "minilm", "1"),
        ("worker-sim#1", "sim", None), ("worker-sim#2", "sim", None),
    ]  # fmt: skip
    assert [instance_of(name) for name, _m, _g in plan][-2:] == [
        ["--instance", "1"], ["--instance", "2"],
    ]  # fmt: skip
    assert instance_of("worker-sim") == []
    # Two copies never share a consumer name (each would re-read the other's batch).
    names = {default_consumer_name("sim", "sim", n) for n in (1, 2)}
    assert len(names) == 2 and default_consumer_name("sim", "sim") not in names
