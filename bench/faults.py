"""The fault suite's tables: ``make faults`` runs tests/faults and writes
bench/results/faults.json (tests/faults/conftest.py); docs/reliability.md shows them."""

from __future__ import annotations

from dataclasses import dataclass

from bench.report import Results, measured_on, table
from harness.accounting import Figures


@dataclass
class Report:
    """bench/results/faults.json besides its head (bench.report.typed reads it): each
    scenario's witnessed counts, as the fault suite's accounting gives them."""

    scenarios: list[Figures]


RESULT = Report

# --- the fault-injection suite (faults.json, make faults) ----------------------------------


def fault_scenarios(results: Results, generation: bool) -> list[Figures]:
    """The scenarios of ``make faults``'s run, in the suite's order (its test ids)."""
    scenarios = results.typed("faults", Report).scenarios
    found = [s for s in scenarios if ("tokens_lost" in s.details) == generation]
    return sorted(found, key=lambda s: (s.details.get("test", ""), s.scenario))


def faults_intro(results: Results) -> str:
    doc = results["faults"]
    failed = doc["settings"].get("tests_failed", 0)
    verdict = "every test passed" if not failed else f"**{failed} tests failed**"
    return f"{measured_on(doc)}, `make faults` ({verdict}; the counts are the witnesses'):"


def render_faults(results: Results) -> list[str]:
    rows = [
        [
            s.scenario,
            f"{s.submitted:,}",
            f"{s.completed:,}",
            str(s.lost),
            f"{s.executions:,}",
            str(s.after_crash),
            str(s.run_twice),
            str(s.written_twice),
            f"{s.seconds:.1f}",
        ]
        for s in fault_scenarios(results, generation=False)
    ]
    header = ["scenario", "submitted", "completed", "lost", "computations",
              "again after a crash", "computed twice", "written twice", "seconds"]  # fmt: skip
    return [faults_intro(results), "", *table(header, "l" + "r" * 8, rows)]


def render_faults_generation(results: Results) -> list[str]:
    rows = []
    for s in fault_scenarios(results, generation=True):
        d = s.details
        rows.append(
            [
                s.scenario,
                str(s.submitted),
                str(s.completed),
                str(s.lost),
                str(s.executions),
                str(s.after_crash),
                str(s.run_twice),
                str(d["tokens_lost"]),
                f"{d['streamed_twice']} / {d['stream_gaps']}",
                str(s.written_twice),
                f"{s.seconds:.1f}",
            ]
        )
    header = ["generation scenario", "submitted", "completed", "lost", "runs", "taken over",
              "restarted from zero", "tokens lost", "token indices twice / missing",
              "written twice", "seconds"]  # fmt: skip
    return [faults_intro(results), "", *table(header, "l" + "r" * 10, rows)]
