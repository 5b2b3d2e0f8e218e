"""Dependencies point one way (docs/architecture.md §1), checked on the source itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"api", "core", "workers", "scheduler", "ferry", "migrations", "tests", "bench", "backends"}
ALLOWED = {
    "backends": {"core"},
    "scheduler": set(),
    "core": set(),
    "api": {"core", "backends"},
    "workers": {"core", "scheduler", "backends"},
    "migrations": {"core"},
}
# The batching policy is a pure function: no clock, no sleeping, no I/O, no torch.
SCHEDULER_FORBIDDEN = {"time", "datetime", "redis", "torch", "asyncio", "sqlalchemy", "random"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_the_design_allows(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    for path in files:
        ours = (imports_of(path) & OURS) - {package}
        assert ours <= ALLOWED[package], f"{path.relative_to(ROOT)} imports {ours}"


def test_the_scheduler_touches_no_clock_io_or_torch() -> None:
    for path in (ROOT / "scheduler").rglob("*.py"):
        assert not imports_of(path) & SCHEDULER_FORBIDDEN, path


def test_the_api_never_imports_torch() -> None:
    for package in ("api", "core"):
        for path in (ROOT / package).rglob("*.py"):
            assert "torch" not in imports_of(path), path
