"""make test-report: the JUnit XML and steps.tsv read back into files, tests and steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.suite_report import (
    Case,
    Step,
    WorkerSpan,
    before_pytest_s,
    busiest_files,
    cpu_of,
    main,
    outcomes,
    parse_junit,
    parse_steps,
    render,
    slowest_files,
    slowest_tests,
    worker_spans,
)

pytest_plugins = ["pytester"]

# What pytest writes (xunit1: a file attribute per case), trimmed to a few cases.
JUNIT_XUNIT1 = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1"
 skipped="1" tests="5" time="40.5">
<testcase classname="tests.unit.test_a" name="test_one" file="tests/unit/test_a.py"
 line="3" time="1.250" />
<testcase classname="tests.unit.test_a.TestGroup" name="test_two[sqlite]"
 file="tests/unit/test_a.py" line="9" time="0.750" />
<testcase classname="tests.faults.test_kill" name="test_kill" file="tests/faults/test_kill.py"
 line="20" time="30.000"><properties><property name="bench_e2e_s" value="12" />
<property name="fault_figures" value="{&quot;lost&quot;: 0}" /></properties>
<failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.e2e.test_stack" name="test_up" file="tests/e2e/test_stack.py"
 line="5" time="8.000"><skipped type="pytest.skip" message="no wrk">skip</skipped></testcase>
<testcase classname="tests.e2e.test_stack" name="test_down" file="tests/e2e/test_stack.py"
 line="50" time="0.500"><error message="fixture failed">trace</error></testcase>
</testsuite></testsuites>
"""

# xunit2 has no file attribute: the file comes from the classname.
JUNIT_XUNIT2 = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="2">
<testcase classname="tests.integration.test_api_jobs.TestSubmit" name="test_x" time="2.5" />
<testcase classname="tests.integration.test_api_jobs" name="test_y" time="" />
</testsuite></testsuites>
"""


def test_parse_junit_reads_each_case_with_its_file_time_and_outcome() -> None:
    cases = parse_junit(JUNIT_XUNIT1)
    assert cases == [
        Case("tests/unit/test_a.py", "test_one", 1.25, "passed"),
        Case("tests/unit/test_a.py", "test_two[sqlite]", 0.75, "passed"),
        Case(
            "tests/faults/test_kill.py",
            "test_kill",
            30.0,
            "failed",
            (("bench_e2e_s", "12"), ("fault_figures", '{"lost": 0}')),
        ),
        Case("tests/e2e/test_stack.py", "test_up", 8.0, "skipped"),
        Case("tests/e2e/test_stack.py", "test_down", 0.5, "error"),
    ]
    assert outcomes(cases) == {"passed": 2, "failed": 1, "skipped": 1, "error": 1}


def test_without_a_file_attribute_the_classname_less_its_class_is_the_file() -> None:
    cases = parse_junit(JUNIT_XUNIT2)
    assert [(case.file, case.time_s) for case in cases] == [
        ("tests/integration/test_api_jobs.py", 2.5),
        ("tests/integration/test_api_jobs.py", 0.0),
    ]


def test_files_are_ranked_by_their_tests_summed_time() -> None:
    cases = parse_junit(JUNIT_XUNIT1)
    assert slowest_files(cases) == [
        ("tests/faults/test_kill.py", 30.0, 1),
        ("tests/e2e/test_stack.py", 8.5, 2),
        ("tests/unit/test_a.py", 2.0, 2),
    ]
    assert slowest_files(cases, count=1) == [("tests/faults/test_kill.py", 30.0, 1)]
    assert [case.name for case in slowest_tests(cases, count=2)] == ["test_kill", "test_up"]


def test_only_the_venv_and_the_compiling_come_before_pytest() -> None:
    steps = parse_steps(
        "venv\t1.50\t0\nmypy\t50.00\t0\n\nchecks\t80.25\t0\ncompile\t2.00\t0\n"
        "assert-cache\t8.25\t0\npytest\t900.00\t1\n"
    )
    assert steps[0] == Step("venv", 1.5, 0)
    assert steps[-1] == Step("pytest", 900.0, 1)
    # The checks (mypy among them) run beside pytest: none of their time comes before it.
    assert before_pytest_s(steps) == 1.5 + 2.0 + 8.25


def test_render_names_the_counts_the_slowest_and_a_failed_step() -> None:
    text = render(parse_junit(JUNIT_XUNIT1), parse_steps("venv\t2.0\t0\nchecks\t10.0\t2\n"))
    assert "before pytest: 2.0 s" in text
    assert "(exit 2)" in text
    assert "bench_e2e_s=12" in text  # a slow test's recorded seconds, under it
    assert "lost" not in text  # its other properties are not timings
    assert "tests: 5 (2 passed, 1 skipped, 1 failed, 1 error), 40.5 s in all" in text
    assert text.index("tests/faults/test_kill.py") < text.index("tests/unit/test_a.py")


def test_main_prints_the_report_and_fails_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path)]) == 1
    (tmp_path / "junit.xml").write_text(JUNIT_XUNIT2)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tests: 2 (2 passed" in out
    assert "before pytest" not in out  # no steps.tsv: nothing to say about it


def test_files_are_ranked_by_the_cpu_their_tests_recorded() -> None:
    cases = [
        Case("tests/a.py", "t1", 50.0, "passed", (("cpu_s", "2.5"),)),
        Case("tests/a.py", "t2", 1.0, "passed", (("cpu_s", "1.0"),)),
        Case("tests/b.py", "t3", 5.0, "passed", (("cpu_s", "9.0"), ("bench_x_s", "4"))),
        Case("tests/c.py", "t4", 9.0, "passed"),  # recorded none: counts 0
    ]
    assert [cpu_of(case) for case in cases] == [2.5, 1.0, 9.0, 0.0]
    assert busiest_files(cases) == [("tests/b.py", 9.0, 1), ("tests/a.py", 3.5, 2),
                                    ("tests/c.py", 0.0, 1)]  # fmt: skip
    text = render(cases, [])
    assert "65.0 s in all, 12.5 CPU s" in text
    assert text.index("most CPU") < text.index("       9.0     1  tests/b.py")


def test_every_test_records_its_cpu_seconds_into_the_junit_xml(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "from tests.conftest import pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401"
    )
    pytester.makepyfile(
        test_spin="""
import subprocess, sys, time

def test_spins():
    until = time.process_time() + 0.3
    while time.process_time() < until:
        pass

def test_a_child_spins():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time() + 0.3\\n"
                    "while time.process_time() < t: pass"], check=True)

def test_idles():
    time.sleep(0.3)
"""
    )
    result = pytester.runpytest_inprocess("-p", "no:randomly", "--junitxml=junit.xml")
    result.assert_outcomes(passed=3)
    cpu = {c.name: cpu_of(c) for c in parse_junit((pytester.path / "junit.xml").read_text())}
    assert cpu["test_spins"] >= 0.25 and cpu["test_a_child_spins"] >= 0.25, cpu
    assert cpu["test_idles"] < 0.2, cpu
    # Each case also says which worker ran it (the one running this test, or pytest's
    # own process) and when it ended.
    spans = worker_spans(parse_junit((pytester.path / "junit.xml").read_text()))
    here = os.environ.get("PYTEST_XDIST_WORKER", "main")
    assert [(s.worker, s.tests) for s in spans] == [(here, 3)], spans
    assert spans[0].ended_s >= 0.9, spans  # three tests of 0.3 s one after the other


def test_worker_spans_say_when_each_worker_ended_and_how_long_the_last_ran_alone() -> None:
    def case(worker: str, ended_at: float, time_s: float) -> Case:
        props = (("worker", worker), ("ended_at", str(ended_at)))
        return Case("tests/a.py", f"t{ended_at}", time_s, "passed", props)

    cases = [case("gw0", 110.0, 10.0), case("gw0", 130.0, 20.0), case("gw1", 105.0, 5.0),
             case("gw1", 400.0, 200.0), Case("tests/b.py", "untimed", 3.0, "passed")]  # fmt: skip
    assert worker_spans(cases) == [WorkerSpan("gw0", 0.0, 30.0, 30.0, 2),
                                   WorkerSpan("gw1", 0.0, 300.0, 205.0, 2)]  # fmt: skip
    text = render(cases, [])
    assert "the last worker ran on alone for 270.0 s" in text
    assert worker_spans(cases[-1:]) == []  # a report without the properties: no spans
