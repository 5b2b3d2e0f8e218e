"""tests/assert_cache.py: pytest's rewritten bytecode written once, read by the next run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _project(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["t"]\n')
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "conftest.py").write_text("")
    (tmp_path / "t" / "helper.py").write_text("VALUE = 1\n")
    (tmp_path / "t" / "test_a.py").write_text(
        "def test_a():\n    left, right = 1, 2\n    assert left == right\n"
    )
    return tmp_path


def _pytest(project: Path, *args: str, write_bytecode: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(ROOT)
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _cached(project: Path) -> set[str]:
    return {p.name.split(".")[0] for p in (project / "t" / "__pycache__").glob("*-pytest-*.pyc")}


def test_the_test_modules_are_cached_a_run_without_bytecode_reads_them_and_a_change_is_seen(
    tmp_path: Path,
) -> None:
    project = _project(tmp_path)
    done = _pytest(project, "-p", "tests.assert_cache", write_bytecode=True)
    assert done.returncode == 0, done.stdout + done.stderr
    # The root conftest was rewritten by pytest as it loaded it, the test module by the hook;
    # a helper pytest does not rewrite is left to Python.
    assert "1 of 2 files written" in done.stdout, done.stdout
    assert _cached(project) == {"conftest", "test_a"}

    log = project / "debug.log"
    run = _pytest(project, f"--debug={log}", write_bytecode=False)
    trace = log.read_text()
    assert f"found cached rewritten pyc for {project / 't' / 'test_a.py'}" in trace
    assert f"rewriting {project / 't' / 'test_a.py'!r}" not in trace
    assert f"rewriting {project / 't' / 'conftest.py'!r}" not in trace
    # Read from the cache, the asserts are still rewritten: the failure shows the values.
    assert run.returncode == 1 and "assert 1 == 2" in run.stdout, run.stdout

    # A module changed since is written again (its cache holds another source's hash).
    (project / "t" / "test_a.py").write_text("def test_a():\n    assert True\n")
    again = _pytest(project, "-p", "tests.assert_cache", write_bytecode=True)
    assert "1 of 2 files written" in again.stdout, again.stdout


def test_it_refuses_to_run_where_bytecode_is_not_written(tmp_path: Path) -> None:
    project = _project(tmp_path)
    done = _pytest(project, "-p", "tests.assert_cache", write_bytecode=False)
    assert done.returncode != 0
    assert "unset PYTHONDONTWRITEBYTECODE" in done.stderr, done.stderr
    assert not (project / "t" / "__pycache__").exists()
