"""Shared fixtures: a real Redis and real databases (SQLite and PostgreSQL).

A service that cannot be reached on a fresh machine is started (redis-server)
or its tests skip with the reason; under CI=true nothing may skip for a
missing service. Finding and starting services is ``harness``'s; this file
only turns its ``ServiceMissing`` into the skip or the failure.
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import NoReturn

import pytest
import redis
from sqlalchemy import delete

from core.db import migrate
from core.db.schema import Base, make_engine

# The harness asserts on the tests' behalf: its failures read as a test's own do.
ASSERTS_REWRITTEN = ("harness",)
pytest.register_assert_rewrite(*ASSERTS_REWRITTEN)

from harness import ports  # noqa: E402
from harness.services import ServiceMissing, postgres_database, reachable_redis, started_redis  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() == "true"

# Under pytest-xdist (make test: -n with --dist loadgroup) each of these groups runs
# on one worker, a test after the other, while the other workers share the rest,
# one test at a time: the fault scenarios, which kill, stall and cut the processes
# of stacks of their own and count what came of it, and the tests that start many
# processes on hosts or ports of their own (the network namespaces, a Redis
# cluster, a Sentinel set). A group's files are the ones its prefix starts (the first
# prefix that does): the generation scenarios are a group of their own, beside the
# others, so that the fault suite is not one worker's twelve minutes.
XDIST_GROUPS = {
    "tests/faults/test_generation": "generation-faults",
    # The longest of the others (a flood, a full disk, clocks stepped, a backfill killed):
    # a second group beside the first, so that neither is a worker's ten minutes.
    "tests/faults/test_backfill_kill": "faults-2",
    "tests/faults/test_disk_full": "faults-2",
    "tests/faults/test_overload": "faults-2",
    "tests/faults/test_clock_step": "faults-2",
    "tests/faults/test_api_crash": "faults-2",
    "tests/faults/": "faults",
    "tests/multihost/": "hosts",
    "tests/integration/test_cluster.py": "hosts",
    "tests/integration/test_sentinel.py": "hosts",
}


def missing_service(reason: str) -> NoReturn:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: services must be there)")
    pytest.skip(reason)


def dev_tool(name: str, wheel: str) -> str:
    """The path of a command a dev dependency's wheel ships (``wheel``): the virtual
    environment's first, else the PATH's; missing, a skip (a failure under CI=true)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        # Only where the wheel has none for this platform (the dev extra installs it elsewhere).
        missing_service(f"{name} is not installed (the dev extra's {wheel} brings it)")
    return found


def _missing_service_skips() -> Generator[None, object, object]:
    try:
        return (yield)
    except ServiceMissing as exc:
        missing_service(str(exc))


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        ports.claim_block()  # this worker's ports (harness.ports), not its children's


def xdist_group(path: str) -> str | None:
    """The xdist group of a test file (its path from the repository root), if any."""
    return next((g for prefix, g in XDIST_GROUPS.items() if path.startswith(prefix)), None)


def xdist_scope(nodeid: str) -> str:
    """What pytest-xdist hands a worker at once for a test: its group, else the test alone."""
    return xdist_group(nodeid.split("::", 1)[0]) or nodeid


# Tests of a minute or more that are in no group, in the order they are handed out: before
# every other test outside a group (xdist hands out the groups first, the biggest first),
# so that none starts last, whatever the order, and runs on alone after the others are done
# (a shuffled run's bench smoke test did, for 76 s).
LONG_TESTS = (
    "tests/e2e/test_bench_smoke.py",
    "tests/e2e/test_backfill_stack.py::test_a_100k_line_file",
    "tests/e2e/test_shipped_lm_stack.py",
)


def long_test_rank(nodeid: str) -> int:
    """Where a test is handed out among those outside a group: its place in LONG_TESTS,
    else after them all (sorting by it keeps the others in their order)."""
    return next((i for i, p in enumerate(LONG_TESTS) if nodeid.startswith(p)), len(LONG_TESTS))


@pytest.hookimpl(trylast=True)  # after a shuffle (random-order's hook), not undone by it
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: long_test_rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """--dist loadgroup by XDIST_GROUPS. pytest-xdist's own reads xdist_group marks from a
    suffix it writes into each test's node id, which pytest 9.2 no longer reads back: its
    groups would silently be single tests."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return GroupScheduling(config, log)


CPU_AT = pytest.StashKey[float]()


def cpu_s() -> float:
    """CPU seconds of this process (all its threads) and of its children it has reaped
    (a stack's processes, once stopped: ``ferry up`` reaps its own)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    """A service the harness finds missing in a fixture skips the test (fails it under CI)."""
    item.stash[CPU_AT] = cpu_s()
    return (yield from _missing_service_skips())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    """Each test's CPU seconds, setup to teardown, as its ``cpu_s`` property in the JUnit
    XML: the suite is bound by its CPU on two cores, so make test-report ranks by it too.
    A module or session fixture's processes count where they are set up and stopped."""
    try:
        return (yield)
    finally:
        started = item.stash.get(CPU_AT, None)
        if started is not None:
            item.user_properties.append(("cpu_s", round(cpu_s() - started, 1)))
        # Which worker ran it and when it ended (the epoch's seconds): make test-report
        # shows each worker's span, and how long the last ones ran on while others idled.
        item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))
        item.user_properties.append(("ended_at", round(time.time(), 2)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """Likewise in the test's body (a stack built there needs its own database)."""
    return (yield from _missing_service_skips())


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """FERRY_TEST_REDIS_URL, else the local Redis on 6379, else one we start."""
    url = reachable_redis()
    if url is not None:
        yield url
        return
    with started_redis(tmp_path_factory.mktemp("redis")) as started_url:
        yield started_url


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix of this test's own, deleted afterwards."""
    prefix = f"ferrytest-{secrets.token_hex(4)}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


DATABASES = ("sqlite", "postgresql")


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``one_database(name)`` runs on that database, not on each.

    Tests of storage (the job path, conditional writes, backfills, usage) run on
    both databases; a module whose subject is elsewhere (a client library, the
    worker's pipelining, Celery) says so with the marker, and runs once. The
    marker becomes a parametrize mark before pytest's own hooks read them, so
    the test's id still names its database.
    """
    marker = metafunc.definition.get_closest_marker("one_database")
    if marker is None or "migrated_database_url" not in metafunc.fixturenames:
        return
    (name,) = marker.args
    assert name in DATABASES, f"one_database: {name!r} is not one of {DATABASES}"
    metafunc.definition.add_marker(
        pytest.mark.parametrize("migrated_database_url", [name], indirect=True)
    )


@pytest.fixture(scope="session", params=DATABASES)
def migrated_database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A database of this test session's own, migrated to head, per backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'ferry.db'}"
        migrate.upgrade(url)
        yield url
        return
    with postgres_database() as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture
def database_url(migrated_database_url: str) -> Iterator[str]:
    """The session's database, emptied after each test."""
    yield migrated_database_url
    engine = make_engine(migrated_database_url)
    try:
        with engine.begin() as conn:
            # Children before parents: every table, in reverse dependency order.
            for table in reversed(Base.metadata.sorted_tables):
                conn.execute(delete(table))
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def run_ferry(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    """Run the ferry command as a user would; returns stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "ferry", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
