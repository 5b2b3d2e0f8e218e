"""The soak's pure parts: its kill schedule, its verdict from the witnesses, its memory figures,
its plot's data and its rendering (bench/soak.py, bench/render.py)."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from backends.sim import Witnessed
from bench import report, soak
from harness.accounting import count_computations, tally
from harness.submitting import Submission
from harness.witness import Transition

HOUR = 3600.0
DEFAULT_EVERY = {"worker": 240.0, "api": 480.0, "redis": 720.0}


def test_an_hour_has_several_kills_of_each_kind_none_close_to_another() -> None:
    schedule = soak.kill_schedule(HOUR, DEFAULT_EVERY)
    kinds = Counter(kind for _, kind in schedule)
    assert kinds == {"worker": 15, "api": 7, "redis": 5}
    times = [at for at, _ in schedule]
    assert times == sorted(times)
    assert all(0 < at < HOUR for at in times)
    assert all(b - a >= soak.KILL_GAP_S for a, b in itertools.pairwise(times))
    # Steady: each kind's kills stay about an interval apart (a clash delays one by the gap).
    for kind, period in DEFAULT_EVERY.items():
        own = [at for at, k in schedule if k == kind]
        assert own[0] >= period / 2
        gaps = [b - a for a, b in itertools.pairwise(own)]
        assert all(period - 2 * soak.KILL_GAP_S <= g <= period + 2 * soak.KILL_GAP_S for g in gaps)


def test_a_kind_every_zero_seconds_is_never_killed_and_a_short_run_has_a_short_gap() -> None:
    schedule = soak.kill_schedule(HOUR, {"worker": 600.0, "api": 0.0, "redis": 0.0})
    assert {kind for _, kind in schedule} == {"worker"}
    assert [at for at, _ in schedule] == [300.0, 900.0, 1500.0, 2100.0, 2700.0, 3300.0]
    # Seconds long (the smoke run): the gap shrinks to half the shortest interval.
    short = soak.kill_schedule(6.0, {"worker": 2.0, "api": 3.0, "redis": 4.0})
    assert short == [(1.0, "worker"), (2.0, "api"), (3.0, "redis"), (4.0, "worker"),
                     (5.0, "api")]  # fmt: skip
    assert soak.kill_schedule(HOUR, {"worker": 0.0}) == []


def _row(status: str, tag: str, nonce: str | None, attempts: int = 1) -> Any:
    output = {"nonce": nonce} if nonce else None
    return SimpleNamespace(status=status, attempts=attempts, input={"tag": tag}, output=output)


def _moves(job: str, *statuses: str) -> list[Transition]:
    seen, old = [], None
    for status in statuses:
        seen.append(Transition(job, old, status, "t"))
        old = status
    return seen


def test_the_verdict_comes_from_the_transition_log_and_the_sims_record() -> None:
    """Five accepted jobs: one fine, one computed again after its worker was killed in its last
    batch (allowed), one computed twice by a worker that lived (run twice), one made terminal
    twice (written twice) and one never made terminal (lost)."""
    jobs = ["ok", "rerun", "twice", "written", "lost"]
    submission = Submission(ids=dict(enumerate(jobs)))
    killed, alive = 101, 202
    witnessed = [
        Witnessed(alive, 1, 1.0, (("t-ok", "n1"), ("t-twice", "n2"))),
        Witnessed(alive, 2, 2.0, (("t-twice", "n3"), ("t-written", "n4"))),
        Witnessed(killed, 1, 3.0, (("t-rerun", "n5"),)),  # its last batch: then it died
        Witnessed(alive, 3, 4.0, (("t-rerun", "n6"),)),
    ]
    rows = {
        "ok": _row("succeeded", "t-ok", "n1"),
        "rerun": _row("succeeded", "t-rerun", "n6", attempts=2),
        "twice": _row("succeeded", "t-twice", "n3", attempts=2),
        "written": _row("succeeded", "t-written", "n4"),
        "lost": _row("queued", "t-lost", None),
    }
    transitions = {
        "ok": _moves("ok", "queued", "running", "succeeded"),
        "rerun": _moves("rerun", "queued", "running", "running", "succeeded"),
        "twice": _moves("twice", "queued", "running", "succeeded"),
        "written": [
            *_moves("written", "queued", "running", "succeeded"),
            Transition("written", "succeeded", "succeeded", "t"),
        ],
        "lost": _moves("lost", "queued"),
    }
    job_of_tag = {row.input["tag"]: job for job, row in rows.items()}
    computations = count_computations(witnessed, job_of_tag, died={killed})
    figures = tally("soak", submission, rows, transitions, computations, 1.0, 3)

    assert (figures.submitted, figures.completed, figures.lost) == (5, 4, 1)
    assert figures.written_twice == 1 and figures.details["written_twice_ids"] == ["written"]
    assert figures.run_twice == 1 and figures.details["run_twice_ids"] == ["twice"]
    assert figures.after_crash == 1 and figures.details["after_crash_ids"] == ["rerun"]
    assert figures.executions == 6
    assert soak.problems(figures) == ["1 lost", "1 written twice", "1 run twice"]


def test_a_clean_count_has_no_problem_and_a_result_with_no_computation_is_one() -> None:
    submission = Submission(ids={0: "a"})
    rows = {"a": _row("succeeded", "t-a", "n1")}
    transitions = {"a": _moves("a", "queued", "running", "succeeded")}
    witnessed = [Witnessed(1, 1, 1.0, (("t-a", "n1"),))]
    clean = tally("soak", submission, rows, transitions,
                  count_computations(witnessed, {"t-a": "a"}, set()), 1.0, 3)  # fmt: skip
    assert soak.problems(clean) == []
    unexecuted = tally("soak", submission, rows, transitions,
                       count_computations([], {"t-a": "a"}, set()), 1.0, 3)  # fmt: skip
    assert soak.problems(unexecuted) == ["results with no computation behind them"]


def _sample(t: float, **rss: tuple[int, float]) -> dict[str, Any]:
    return {
        "t_s": t,
        "rss_mib": {name: mib for name, (_, mib) in rss.items()},
        "pid": {name: pid for name, (pid, _) in rss.items()},
    }


SAMPLES = [
    _sample(0, flower=(5, 50.0), **{"worker-1": (10, 40.0)}),
    _sample(60, flower=(5, 90.0), **{"worker-1": (10, 60.0)}),
    _sample(120, flower=(5, 95.0), **{"worker-1": (10, 61.0)}),
    _sample(180, flower=(5, 96.0)),  # worker-1 killed, not yet started again
    _sample(240, flower=(5, 96.5), **{"worker-1": (11, 45.0)}),
    _sample(300, flower=(5, 97.0), **{"worker-1": (11, 62.0)}),
    _sample(360, flower=(5, 96.0), **{"worker-1": (11, 62.5)}),
    _sample(420, flower=(5, 96.0), **{"worker-1": (11, 63.0)}),
]


def test_memory_is_compared_after_the_warm_up_with_each_life_apart() -> None:
    assert [len(life) for life in soak.lives(SAMPLES, "worker-1")] == [3, 4]
    summary = soak.memory_summary(SAMPLES, warmup_s=60.0)
    assert summary["flower"] == {
        "start_mib": 90.0, "end_mib": 96.0, "peak_mib": 97.0, "lives": 1,
        "longest_life_min": 7.0, "longest_life_start_mib": 90.0, "longest_life_end_mib": 96.0,
    }  # fmt: skip
    worker = summary["worker-1"]
    assert (worker["start_mib"], worker["end_mib"], worker["peak_mib"]) == (60.0, 63.0, 63.0)
    assert worker["lives"] == 2
    # The longest life is the second (3 minutes), compared from a minute into it.
    assert worker["longest_life_min"] == 3.0
    assert (worker["longest_life_start_mib"], worker["longest_life_end_mib"]) == (62.0, 63.0)
    assert soak.settled_after(SAMPLES) == 42  # a tenth of a 7-minute run
    assert soak.settled_after([{"t_s": HOUR}]) == soak.WARMUP_S


def _doc(samples: list[dict[str, Any]], kills: dict[str, list[float]]) -> dict[str, Any]:
    return {"memory": {"samples": samples}, "kills": kills}


def test_the_plot_groups_the_processes_and_counts_the_kills_as_steps() -> None:
    samples = [
        _sample(
            10.0 * i,
            redis=(1, 10.0),
            flower=(2, 100.0 + i),
            **{"api-1": (3, 80.0), "celery-beat": (4, 70.0), "worker-2": (5, 60.0)},
        )
        for i in range(1000)
    ]
    charts = soak.plot_series(_doc(samples, {"worker": [60.0, 300.0], "redis": [120.0]}))
    titles = [title for title, _, _ in charts]
    assert titles == [
        "API processes and sim workers: resident memory",
        "Celery and Flower: resident memory",
        "Redis: resident memory",
        "Kills so far (SIGKILL)",
    ]
    lines = {title: {s.label: s for s in series} for title, _, series in charts}
    assert set(lines[titles[0]]) == {"api-1", "worker-2"}
    assert set(lines[titles[1]]) == {"celery-beat", "flower"}
    assert set(lines[titles[2]]) == {"redis"}
    flower = lines[titles[1]]["flower"].points
    # At most PLOT_POINTS points (and the last sample), in minutes.
    assert len(flower) <= soak.PLOT_POINTS + 1
    assert flower[0] == (0.0, 100.0) and flower[-1] == (9990.0 / 60, 1099.0)
    kills = lines[titles[3]]
    assert kills["worker"].points == [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (5.0, 1.0),
                                      (5.0, 2.0), (166.5, 2.0)]  # fmt: skip
    assert kills["api"].points == [(0.0, 0.0), (166.5, 0.0)]
    assert kills["redis"].points[-1] == (166.5, 1.0)


def test_a_process_missing_from_a_sample_leaves_a_gap_in_its_line(tmp_path: Path) -> None:
    charts = soak.plot_series(_doc(SAMPLES, {"worker": [170.0]}))
    worker = next(s for _, _, lines in charts for s in lines if s.label == "worker-1")
    assert math.isnan(worker.points[3][1]) and worker.points[3][0] == 3.0
    path = tmp_path / "soak.svg"
    soak.write_plot(_doc(SAMPLES, {"worker": [170.0]}), path)
    svg = path.read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") >= 4
    assert "Celery and Flower: resident memory" in svg and "worker-1" in svg


def test_the_report_renders_the_witnesses_counts_and_each_processs_memory(
    tmp_path: Path,
) -> None:
    summary = soak.memory_summary(SAMPLES, 60.0)
    doc = {
        "date": "2026-12-05T01:00:00+00:00",
        "machine": {"cpu": "CPU", "cores": 2, "memory_gib": 8, "gpu": None},
        "git": {"commit": "c" * 40},
        "settings": {"minutes": 60, "rate_per_s": 30, "redis_down_s": 1,
                     "kill_every_s": {"worker": 240, "api": 480, "redis": 720}},
        "submitted": 108000, "completed": 108000, "lost": 0, "written_twice": 0,
        "run_twice": 0, "after_crash": 12, "executions": 108012, "seconds": 3600.0,
        "problems": [],
        "kills": {"worker": [1.0] * 15, "api": [2.0] * 7, "redis": [3.0] * 5},
        "victims": soak.VICTIM, "exits": {"worker-1": [-9] * 15, "api-1": [-9] * 7},
        "details": {"statuses": {"succeeded": 108000}, "retried": {"ConnectError": 40},
                    "replayed_after_retry": 3, "reenqueued": 9, "announced_twice": 0,
                    "unannounced_terminal": 2, "missing_rows": 0, "attempts": {"1": 108000},
                    "bad_attempts": 0, "executions_per_job": {"1": 107988, "2": 12},
                    "succeeded_unexecuted": [], "terminal_untracked": [],
                    "untagged_computations": 0, "after_crash_ids": [], "run_twice_ids": [],
                    "written_twice_ids": [], "lost_ids": [], "rejected": [],
                    "submit_s": 3600.0},
        "memory": {"settled_after_s": 60, "summary": summary, "samples": SAMPLES},
    }  # fmt: skip
    (tmp_path / "soak.json").write_text(json.dumps(doc))
    lines = soak.render_soak(report.Results(tmp_path))
    text = "\n".join(lines)
    assert "**108,000 jobs accepted, 108,000 made terminal (108,000 succeeded): 0 lost" in text
    assert "0 written twice, 0 run twice**" in text
    assert "a sim worker 15 times (every 240 s), an API process 7 times (every 480 s)" in text
    assert "Redis 5 times (every 720 s)" in text and "12 computed again after a kill" in text
    assert "retried 40 requests" in text and "enqueued 9 jobs again" in text
    assert "| flower | 1 | 90.0 → 96.0 | 97.0 | the whole run |" in lines
    assert "| worker-1 (killed) | 2 | 60.0 → 63.0 | 63.0 | 3 min: 62.0 → 63.0 |" in lines
    assert "Problems" not in text
    doc["problems"] = ["1 lost"]
    (tmp_path / "soak.json").write_text(json.dumps(doc))
    assert "Problems: 1 lost." in "\n".join(soak.render_soak(report.Results(tmp_path)))
