"""Fixtures of the fault-injection suite: a real Ferry stack per test, broken on purpose.

The stack is ``harness.faults.Stack``: a redis-server and a PostgreSQL database
(or a SQLite file) of the test's own, the API, workers and Celery processes as separate processes.
Every process started is killed at teardown, whether the test passed or not;
the Redis, the database and the proxy go too, and a failed test prints the
processes' logs. A scenario that stops or fails over the database server
itself asks for ``postgres``: servers of its own (``harness.postgres``), whose
database it hands to ``make_stack(url=...)``.

Each scenario counts, from witnesses the code under test does not keep (see
``harness.witness`` and ``harness.accounting``), what it submitted (202s),
what reached a terminal state and what was lost (accepted, never made
terminal, by the database's transition log, which a trigger installed in the
test's database right after migration fills), how many times each job was
computed by the sim model's record of its computations (again after a crash,
or twice with no crash to explain it), and which jobs were made terminal more
than once (written twice, by the transition log). The figures are printed as
a table at the end of the run (``pytest tests/faults -q -s``) and written as
JSON under the pytest temporary directory. A test's figures travel in its
report (a user property), so the table is complete when pytest-xdist runs the
tests in other processes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from core.db import migrate
from core.db.schema import make_engine
from harness.accounting import HEADER, Figures
from harness.faults import Stack
from harness.postgres import PostgresServers, postgres_servers
from harness.services import migrated_postgres_database, redis_server
from harness.witness import install_transition_witness

FIGURES_PROPERTY = "fault_figures"
# Where `make faults` has the figures written as a results file (bench/results/faults.json).
RESULTS_ENV = "FERRY_FAULTS_RESULTS"
# What this process's tests counted (the JSON file), and what the reports it
# received carried (the table: a pytest-xdist controller runs no test itself).
COUNTED: list[Figures] = []
REPORTED: list[Figures] = []
FAILED = pytest.StashKey[bool]()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown":
        return  # the last of a test's reports: it carries every property the test added
    for name, value in report.user_properties:
        if name == FIGURES_PROPERTY:
            REPORTED.append(Figures(**json.loads(str(value))))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With FERRY_FAULTS_RESULTS set (`make faults`), every scenario's figures as a results
    file, which bench/render.py renders into docs/reliability.md's fault tables."""
    path = os.environ.get(RESULTS_ENV)
    if not path or not REPORTED or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from bench.results import git_state, machine

    failed = session.testsfailed
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "make faults",
        "smoke": False,
        "git": git_state(),
        "machine": machine(),
        "settings": {"tests_failed": failed},
        "scenarios": [asdict(f) for f in REPORTED],
    }
    Path(path).write_text(json.dumps(report, indent=1, default=str) + "\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORTED:
        return
    terminalreporter.write_sep("=", "fault injection: nothing accepted is ever lost")
    terminalreporter.write_line(HEADER)
    terminalreporter.write_line("-" * len(HEADER))
    for figures in REPORTED:
        terminalreporter.write_line(figures.row())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    # Teardown reads this to decide whether to show the processes' logs.
    if report.failed:
        item.stash[FAILED] = True
    return report


@pytest.fixture(scope="session")
def figures_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "faults-figures.json"


@pytest.fixture
def record(
    request: pytest.FixtureRequest, tmp_path: Path, figures_file: Path
) -> Iterator[Callable[[Figures], None]]:
    """Keep a scenario's figures: printed at the end, and written as JSON.

    The JSON is written, and the figures put in the test's report, when the test
    ends, so what a test adds to the details after counting is in them too.
    """
    mine: list[Figures] = []

    def keep(figures: Figures) -> None:
        figures.details["test"] = request.node.nodeid  # the rendered table's order
        mine.append(figures)
        print(f"\n{HEADER}\n{figures.row()}")

    yield keep
    if mine:
        COUNTED.extend(mine)
        for figures in mine:
            as_json = json.dumps(asdict(figures), default=str)
            request.node.user_properties.append((FIGURES_PROPERTY, as_json))
        (tmp_path / "figures.json").write_text(
            json.dumps([asdict(f) for f in mine], default=str, indent=1)
        )
        figures_file.write_text(json.dumps([asdict(f) for f in COUNTED], default=str, indent=1))


@pytest.fixture
def postgres(request: pytest.FixtureRequest) -> Iterator[PostgresServers]:
    """PostgreSQL servers of the test's own, to stop and fail over; gone at teardown, after
    the stack (ask for this fixture before ``make_stack``). A failed test prints their logs."""
    with postgres_servers() as servers:
        yield servers
        if request.node.stash.get(FAILED, False):
            for server in servers.servers:
                print(f"\n---- PostgreSQL {server.name} log ----\n{server.log_tail()}")


@pytest.fixture
def make_stack(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Generator[Callable[..., Stack], None, None]:
    """Builds the test's stack: ``make_stack(proxy_db=False, database="postgresql",
    FERRY_X="...")``; ``database="sqlite"``: a SQLite file of the test's own;
    ``url=...``: a database the test made (on a server of its own, ``postgres``)."""
    redis_server()  # before any test body runs: each stack starts Redis of its own
    with contextlib.ExitStack() as cleanup:
        stacks: list[Stack] = []

        def build(
            proxy_db: bool = False, database: str = "postgresql", url: str = "", **env: str
        ) -> Stack:
            if url:
                migrate.upgrade(url)  # the test's own PostgreSQL server's (``postgres``)
            elif database == "sqlite":
                assert not proxy_db, "the proxy stands before PostgreSQL only"
                url = f"sqlite:///{tmp_path / 'ferry.db'}"
                migrate.upgrade(url)
            else:
                url = cleanup.enter_context(migrated_postgres_database())
            engine = make_engine(url)
            try:
                install_transition_witness(engine)
            finally:
                engine.dispose()
            stack = Stack(tmp_path, url, env, proxy_db=proxy_db)
            stacks.append(stack)
            return stack

        try:
            yield build
        finally:
            for stack in stacks:
                if request.node.stash.get(FAILED, False):
                    print(f"\n---- process logs ({tmp_path}) ----\n{stack.diagnostics()}")
                stack.close()
