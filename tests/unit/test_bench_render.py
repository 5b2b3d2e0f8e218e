"""Every benchmark figure of the documents comes from a results file (bench/render.py)."""
# The documents' typography, as bench/render.py writes it.
# ruff: noqa: RUF001

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bench import backfill, clients, generation_promises, render, report
from bench.results import RESULTS, commit_of, mixed_commits, provenance, write

ROOT = Path(__file__).resolve().parents[2]


def test_the_documents_tables_are_what_their_results_files_render() -> None:
    stale = render.stale(ROOT, report.Results(RESULTS))
    assert not stale, f"{stale}: run python -m bench.render (or regenerate the results)"


def test_every_region_has_a_renderer_and_its_results_files() -> None:
    for document in render.DOCUMENTS:
        for region in render.regions((ROOT / document).read_text(encoding="utf-8")):
            assert region in render.RENDERERS, f"{document}: {region}"
            for name in render.SOURCES[region]:
                assert (RESULTS / f"{name}.json").exists(), f"{document}: {region} reads {name}"


def test_the_documents_cite_one_set_of_results_once_it_is_regenerated() -> None:
    problems = render.same_commit_problems(ROOT, report.Results(RESULTS))
    if render.same_commit_enforced():
        assert not problems, problems
    else:
        # `make bench` sets the flag once every cited file comes from one commit.
        assert problems, "the results are one set now: set same_commit in MANIFEST.json"


def test_a_repeated_figure_is_its_median_and_range() -> None:
    figure = report.Figure.of([1.35, 1.28, 1.32])
    assert figure.text(report.times()) == "1.32× (1.28–1.35)"
    assert figure.text(report.percent(1), bold=True) == "**132.0 %** (128.0–135.0)"
    assert report.Figure.of([7690.8]).text(report.decimal()) == "7,691"


def test_a_range_that_crosses_its_target_is_not_met() -> None:
    crossing = report.Figure.of([1.28, 1.32, 1.35])
    assert not crossing.meets(1.3, at_least=True)
    assert report.Figure.of([1.31, 1.32, 1.35]).meets(1.3, at_least=True)
    assert not report.Figure.of([1.1, 1.15, 1.21]).meets(1.2, at_least=False)
    assert report.verdict(crossing.meets(1.3, at_least=True)) == "**not met**"


def test_repeated_runs_render_with_their_spread_and_verdict() -> None:
    published = json.loads((RESULTS / "backfill.json").read_text())
    one = published["runs"][0] if "runs" in published else published  # a run, as repeats keep it
    runs = []
    for busy, met in ((146.0, True), (150.0, True), (170.0, False)):
        run = copy.deepcopy(one)
        run["busy"]["overall"]["p99_ms"] = run["p99_busy_ms"] = busy
        run["target_met_full_batch"] = met
        runs.append(run)
    results = report.Results(RESULTS)
    summary = published["summary"]  # the renderers read the runs; the file's type has both
    results.read["backfill"] = {**_head("abc"), "settings": {}, "runs": runs, "summary": summary}
    text = "\n".join(backfill.render_backfill_target(results))
    assert "| `p99_busy_ms` | **150.0** (146.0–170.0) |" in text
    assert ": **not met**" in text
    assert "median of 3 runs (min–max)" in "\n".join(backfill.render_backfill_latency(results))


def _head(commit: str | None, changes: list[str] | None = None) -> dict[str, Any]:
    return {"date": "2026-12-02", "git": {"commit": commit, "uncommitted_changes": changes or []}}


def test_files_of_one_commit_are_one_set() -> None:
    assert mixed_commits({"api": _head("a" * 40), "e2e": _head("a" * 40)}) == []


def test_a_file_of_another_commit_or_none_or_a_dirty_tree_is_named() -> None:
    docs = {
        "api": _head("a" * 40),
        "e2e": _head("a" * 40),
        "soak": _head("b" * 40),
        "fairness": {"date": "2026-11-30"},
        "backends": {"commit": "a" * 40},
        "clients": _head("a" * 40, [" M core/db/schema.py"]),
    }
    assert commit_of(docs["backends"]) == "a" * 40
    assert mixed_commits(docs) == [
        "clients: measured with uncommitted changes",
        "fairness: no commit recorded (the set is at aaaaaaa)",
        "soak: measured at bbbbbbb, the set at aaaaaaa",
    ]


def test_a_results_file_says_what_code_machine_and_settings_it_ran() -> None:
    out = Path("out.json")
    head = provenance("e2e", ["--jobs", "16"])
    written: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "write_text", lambda self, text: written.update(json.loads(text)))
        patch.setattr(Path, "mkdir", lambda self, **_: None)
        write(out, {"jobs_per_s": float("nan")}, settings={"jobs": 16}, head=head)
    assert written["command"] == "python -m bench.e2e --jobs 16"
    assert len(written["git"]["commit"]) == 40
    assert {"cpu", "cores", "memory_gib", "gpu"} <= set(written["machine"])
    assert written["settings"] == {"jobs": 16}
    assert written["jobs_per_s"] is None and written["smoke"] is False


def test_a_smoke_runs_file_is_never_rendered_into_the_documents(tmp_path: Path) -> None:
    (tmp_path / "soak.json").write_text(json.dumps({"smoke": True}))
    with pytest.raises(ValueError, match="smoke"):
        report.Results(tmp_path)["soak"]
    assert report.Results(tmp_path, smoke=True)["soak"] == {"smoke": True}


def test_a_round_whose_clients_saw_no_job_finish_renders_without_a_latency(tmp_path: Path) -> None:
    doc = json.loads((RESULTS / "clients.json").read_text())
    stacks = [s for s in doc["stacks"] if not s.get("error")]
    for stack in stacks:
        for name in ("job_p50_ms", "job_p99_ms"):
            stack["summary"][name] = {"median": None, "min": None, "max": None}
    doc["smoke"] = True
    (tmp_path / "clients.json").write_text(json.dumps(doc))
    lines = clients.render_clients(report.Results(tmp_path, smoke=True))
    rows = [line for line in lines if line.startswith("| ") and "jobs/s" not in line]
    assert len(rows) == len(stacks) and all("– / –" in row for row in rows)


def test_a_generation_promises_file_with_figures_of_nothing_still_renders(tmp_path: Path) -> None:
    # A smoke run on a busy machine may measure nothing for a figure: the file says null.
    doc = json.loads((ROOT / "bench/results/generation_promises.json").read_text())
    doc["smoke"] = True
    doc["urgent_ttft_gain"] = {"median": None, "min": None, "max": None}
    doc["rounds"][0]["preemption"]["urgent_ttft_steps"]["preemption"]["p99"] = None
    (tmp_path / "generation_promises.json").write_text(json.dumps(doc))
    text = "\n".join(
        generation_promises.render_generation_promises(report.Results(tmp_path, smoke=True))
    )
    assert "nan× (nan–nan) sooner" in text and "no GPU" in text
