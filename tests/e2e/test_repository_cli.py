"""`ferry models check` and `ferry up` on a repository, as a user runs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"


def ferry(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    return subprocess.run(
        [sys.executable, "-m", "ferry", *args],
        cwd=cwd, env=clean | env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_an_invalid_repository_is_named_and_ferry_up_refuses_it(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "text-stats", tmp_path / "models" / "text-stats")
    checked = ferry(["models", "check"], tmp_path, FERRY_MODELS="text-stats")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "models: ready to serve" in checked.stdout

    toml = tmp_path / "models" / "text-stats" / "model.toml"
    toml.write_text(toml.read_text().replace('backend = "python"', 'backend = "tensorrt"'))
    checked = ferry(["models", "check"], tmp_path, FERRY_MODELS="text-stats")
    assert checked.returncode == 1
    assert "error: models/text-stats/model.toml: backend: unknown backend 'tensorrt'" in (
        checked.stdout
    )
    up = ferry(["up"], tmp_path, FERRY_MODELS="text-stats")
    assert up.returncode == 2
    assert "models/text-stats/model.toml: backend: unknown backend 'tensorrt'" in up.stdout
    assert "cannot be served; not starting" in up.stdout
    assert not (tmp_path / ".ferry").exists()  # nothing was started or written
