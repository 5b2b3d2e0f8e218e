"""The suite's pytest-xdist scopes (tests/conftest.py): a group's tests go to one worker
together, every other test on its own."""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

from tests.conftest import LONG_TESTS, long_test_rank, pytest_xdist_make_scheduler, xdist_scope


def test_a_grouped_file_s_tests_share_their_group_s_scope() -> None:
    assert xdist_scope("tests/faults/test_kill.py::test_a[sqlite]") == "faults"
    assert xdist_scope("tests/faults/test_stall.py::test_b") == "faults"
    # The more particular prefix first: the generation scenarios are a group of their own.
    for name in ("test_generation_faults.py", "test_generation_host_faults.py"):
        assert xdist_scope(f"tests/faults/{name}::test_g") == "generation-faults"
    for name in ("test_overload.py", "test_disk_full.py", "test_clock_step_webhook.py"):
        assert xdist_scope(f"tests/faults/{name}::test_h") == "faults-2"
    assert xdist_scope("tests/multihost/test_hosts.py::test_c") == "hosts"
    assert xdist_scope("tests/integration/test_cluster.py::test_d") == "hosts"


def test_any_other_test_is_a_scope_of_its_own() -> None:
    nodeid = "tests/integration/test_worker.py::test_e[postgresql]"
    assert xdist_scope(nodeid) == nodeid


def test_loadgroup_schedules_by_the_suite_s_groups(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest-xdist asks the suite for its scheduler; with --dist loadgroup it gets one that
    scopes tests by XDIST_GROUPS, with any other --dist its own."""
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"], raising=False)
    monkeypatch.setattr(pytestconfig.option, "dist", "loadgroup", raising=False)
    scheduler = pytest_xdist_make_scheduler(pytestconfig, None)
    assert isinstance(scheduler, LoadScopeScheduling)
    assert scheduler._split_scope("tests/faults/test_kill.py::test_a") == "faults"
    assert (
        scheduler._split_scope("tests/unit/test_cli.py::test_b") == "tests/unit/test_cli.py::test_b"
    )
    monkeypatch.setattr(pytestconfig.option, "dist", "load")
    assert pytest_xdist_make_scheduler(pytestconfig, None) is None


def test_the_long_tests_come_first_in_their_order_and_the_rest_keep_theirs() -> None:
    nodeids = [
        "tests/unit/test_a.py::test_one",
        "tests/e2e/test_shipped_lm_stack.py::test_chat",
        "tests/integration/test_b.py::test_two",
        "tests/e2e/test_bench_smoke.py::test_every_benchmark",
        "tests/unit/test_a.py::test_three",
    ]
    ordered = sorted(nodeids, key=long_test_rank)
    assert ordered == [
        "tests/e2e/test_bench_smoke.py::test_every_benchmark",
        "tests/e2e/test_shipped_lm_stack.py::test_chat",
        "tests/unit/test_a.py::test_one",
        "tests/integration/test_b.py::test_two",
        "tests/unit/test_a.py::test_three",
    ]


def test_every_long_test_exists(pytestconfig: pytest.Config) -> None:
    """A renamed test would silently lose its place at the front."""
    root = pytestconfig.rootpath
    for prefix in LONG_TESTS:
        path, _, name = prefix.partition("::")
        assert (root / path).is_file(), prefix
        assert not name or f"def {name}" in (root / path).read_text(), prefix
