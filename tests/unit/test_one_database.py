"""The ``one_database`` marker (tests/conftest.py): a marked test runs on the database it
names; an unmarked one on each."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest
from tests.conftest import DATABASES, pytest_generate_tests  # noqa: F401

@pytest.fixture(scope="session", params=DATABASES)
def migrated_database_url(request):
    return request.param
"""

TESTS = """
import pytest

def test_on_each(migrated_database_url):
    pass

@pytest.mark.one_database("postgresql")
def test_on_one(migrated_database_url):
    assert migrated_database_url == "postgresql"

@pytest.mark.one_database("postgresql")
def test_without_a_database():
    pass
"""


def _run(pytester: pytest.Pytester, tests: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    one_database(name): one database only\n")
    pytester.makepyfile(test_marked=tests)
    return pytester.runpytest_inprocess("-v", "-p", "no:randomly", "-p", "no:cacheprovider")


def test_a_marked_test_runs_once_on_its_database(pytester: pytest.Pytester) -> None:
    result = _run(pytester, TESTS)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "*test_on_each?sqlite? PASSED*",
            "*test_on_each?postgresql? PASSED*",
            "*test_on_one?postgresql? PASSED*",
            "*test_without_a_database PASSED*",
        ]
    )
    assert "test_on_one[sqlite]" not in result.stdout.str()


def test_an_unknown_database_is_an_error(pytester: pytest.Pytester) -> None:
    result = _run(pytester, TESTS.replace('one_database("postgresql")', 'one_database("mysql")'))
    result.stdout.fnmatch_lines(["*'mysql' is not one of*"])
    assert result.ret != 0
