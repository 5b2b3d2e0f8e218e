"""Dependencies point one way (docs/architecture.md §1), checked on the source itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "api", "core", "workers", "scheduler", "ferry", "migrations", "tests", "bench", "backends",
    "harness",
}  # fmt: skip
ALLOWED = {
    "backends": {"core", "scheduler"},
    "scheduler": set(),
    # core.config derives the batching settings from their one definition, the scheduler's
    # Tuning (scheduler.learning: pure, no clock, no I/O).
    "core": {"scheduler"},
    "api": {"core", "backends"},
    "workers": {"core", "scheduler", "backends"},
    "migrations": {"core"},
}
# core's sub-packages (each __init__ says the same): what each may import of the others.
CORE_ALLOWED = {
    "config": set(),
    "models": set(),
    "streams": {"config"},
    "db": {"config", "models", "streams"},
    "ops": {"config", "models", "streams"},
}
# What ships: none of it starts test stacks, so none of it imports the harness.
PRODUCTION = ("api", "backends", "core", "ferry", "migrations", "scheduler", "workers")
# The batching policy is a pure function: no clock, no sleeping, no I/O, no torch.
SCHEDULER_FORBIDDEN = {"time", "datetime", "redis", "torch", "asyncio", "sqlalchemy", "random"}


# The shared words (lanes, triggers, a batch's work): at the bottom, importable by all.
VOCABULARY = "scheduler.vocabulary"


def modules_of(path: Path) -> set[str]:
    """Every module ``path`` imports, by its full name (absolute imports, lazy ones too).

    ``from core import db`` and ``from core.models import reader`` name the sub-package
    or module they import: ``core.db``, ``core.models.reader``.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            folder = ROOT.joinpath(*node.module.split("."))
            modules |= {
                f"{node.module}.{alias.name}"
                for alias in node.names
                if (folder / alias.name).is_dir() or (folder / f"{alias.name}.py").is_file()
            }
    return modules


def imports_of(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (the vocabulary module counts as none)."""
    return {module.split(".")[0] for module in modules_of(path) if module != VOCABULARY}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_the_design_allows(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    for path in files:
        ours = (imports_of(path) & OURS) - {package}
        assert ours <= ALLOWED[package], f"{path.relative_to(ROOT)} imports {ours}"


def core_imports_of(path: Path) -> set[str]:
    """The core sub-packages ``path`` imports (``core.db.schema`` -> ``db``)."""
    return {m.split(".")[1] for m in modules_of(path) if m.startswith("core.")}


def test_core_is_its_sub_packages_and_each_says_what_lives_there() -> None:
    core = ROOT / "core"
    assert sorted(p.name for p in core.glob("*.py")) == ["__init__.py"]
    packages = sorted(p.parent.name for p in core.glob("*/__init__.py"))
    assert packages == sorted(CORE_ALLOWED)
    for package in packages:
        tree = ast.parse((core / package / "__init__.py").read_text())
        assert ast.get_docstring(tree), package


@pytest.mark.parametrize("package", sorted(CORE_ALLOWED))
def test_core_sub_packages_import_only_what_their_layer_allows(package: str) -> None:
    for path in sorted((ROOT / "core" / package).rglob("*.py")):
        others = core_imports_of(path) - {package}
        assert others <= CORE_ALLOWED[package], f"{path.relative_to(ROOT)} imports core.{others}"


def test_the_model_repository_has_no_import_circle() -> None:
    # Module by module (lazy imports included): none imports one that imports it back.
    folder = ROOT / "core" / "models"
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        prefix = "core.models."
        graph[path.stem] = {
            m.split(".")[2] for m in modules_of(path) if m.startswith(prefix) and m != prefix
        }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
            for nxt in graph.get(start, set())
        )

    circles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not circles, circles


def test_core_takes_of_the_scheduler_only_its_vocabulary_and_the_knobs() -> None:
    # The settings derive the batching knobs from scheduler.learning.Tuning; nothing else
    # of core reaches into the scheduler.
    for path in sorted((ROOT / "core").rglob("*.py")):
        scheduler = {m for m in modules_of(path) if m.split(".")[0] == "scheduler"}
        allowed = {VOCABULARY}
        if path == ROOT / "core" / "config" / "settings.py":
            allowed.add("scheduler.learning")
        assert scheduler <= allowed, f"{path.relative_to(ROOT)} imports {scheduler - allowed}"


def test_the_scheduler_touches_no_clock_io_or_torch() -> None:
    for path in (ROOT / "scheduler").rglob("*.py"):
        assert not imports_of(path) & SCHEDULER_FORBIDDEN, path


def test_the_api_never_imports_torch() -> None:
    for package in ("api", "core"):
        for path in (ROOT / package).rglob("*.py"):
            assert "torch" not in imports_of(path), path


@pytest.mark.parametrize("package", PRODUCTION)
def test_nothing_that_ships_imports_the_harness_or_the_tests(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        found = imports_of(path) & {"harness", "tests", "bench"}
        assert not found, f"{path.relative_to(ROOT)} imports {found}"


def test_benchmarks_share_the_harness_and_import_no_test_module() -> None:
    for path in (ROOT / "bench").rglob("*.py"):
        assert "tests" not in imports_of(path), path.relative_to(ROOT)


def test_the_harness_runs_without_pytest_and_imports_neither_tests_nor_benchmarks() -> None:
    for path in (ROOT / "harness").rglob("*.py"):
        found = imports_of(path) & {"pytest", "tests", "bench"}
        assert not found, f"{path.relative_to(ROOT)} imports {found}"


def test_the_gpu_worker_and_the_celery_tasks_do_not_import_each_other() -> None:
    for package, other in (("gpu", "tasks"), ("tasks", "gpu")):
        for path in (ROOT / "workers" / package).rglob("*.py"):
            crossing = {m for m in modules_of(path) if m.startswith(f"workers.{other}")}
            assert not crossing, f"{path.relative_to(ROOT)} imports {crossing}"


def test_the_vocabulary_imports_nothing_of_ours() -> None:
    modules = modules_of(ROOT / "scheduler" / "vocabulary.py")
    assert not {m.split(".")[0] for m in modules} & OURS, modules


def test_no_route_holds_sql() -> None:
    # A route parses, authorises and answers; what it reads or writes is a service's.
    routes = sorted((ROOT / "api").glob("*/*routes.py"))
    assert routes
    for path in routes:
        assert "sqlalchemy" not in imports_of(path), path.name


# Where the whole settings object is taken: each process's entry (it builds its parts),
# the ``ferry`` tool, and the catalog (a model's settings are the whole object with the
# model's overrides, Settings.for_model). Every other part takes its own section.
SETTINGS_TAKERS = {
    "api/app.py",
    "backends/catalog.py",
    "workers/gpu/main.py",
    "workers/gpu/generation_main.py",
    "workers/tasks/app.py",
}


def imported_names(path: Path, module: str) -> set[str]:
    """The names ``path`` imports from ``module`` (lazy imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == module
        for alias in node.names
    }


def test_only_the_entry_points_take_the_whole_settings() -> None:
    takers = set()
    for package in ("api", "backends", "core", "scheduler", "workers"):
        for path in (ROOT / package).rglob("*.py"):
            name = path.relative_to(ROOT).as_posix()
            if name.startswith("core/config/"):
                continue
            if "Settings" in imported_names(path, "core.config.settings"):
                takers.add(name)
    assert takers == SETTINGS_TAKERS
