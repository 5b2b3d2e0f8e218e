"""The resume benchmark's pure parts (bench/generation_resume.py): the tokens a takeover lost
and generated again, what a job's events stream says, and the figures it reports."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from bench.generation_resume import (
    TAKEOVER_LOG,
    Killed,
    Stream,
    Uninterrupted,
    figures,
    repeat_figures,
    takeover_at,
    tokens_generated_again,
    tokens_lost,
)
from core.streams.events import JobEvent
from harness.lm_witness import Run

PROMPT = 5  # tokens: a run's first sample right after the prompt is at position 4


def run(pid: int, first_index: int | None, last_index: int | None) -> Run:
    """A run that sampled the job's tokens ``first_index`` to ``last_index``."""
    first = None if first_index is None else first_index + PROMPT - 1
    last = None if last_index is None else last_index + PROMPT - 1
    return Run(pid, 0, first, last)


def test_a_run_going_on_from_its_checkpoint_loses_only_what_was_never_streamed() -> None:
    # The victim sampled tokens 0-9 and streamed 0-8 (killed between sampling 9 and
    # streaming it); the taker recomputes 8, the last streamed, then goes on.
    runs = [run(1, 0, 9), run(2, 8, 63)]
    assert tokens_generated_again(runs, PROMPT) == 2  # 8 and 9
    assert tokens_lost(runs, PROMPT) == 1  # 9: 8 is recomputed by design


def test_a_run_going_on_from_everything_the_victim_made_loses_nothing() -> None:
    runs = [run(1, 0, 9), run(2, 9, 63)]
    assert tokens_generated_again(runs, PROMPT) == 1
    assert tokens_lost(runs, PROMPT) == 0


def test_a_run_started_over_from_the_first_token_lost_everything_before_it() -> None:
    runs = [run(1, 0, 9), run(2, 0, 63)]
    assert tokens_generated_again(runs, PROMPT) == 10
    assert tokens_lost(runs, PROMPT) == 10


def test_one_run_or_a_later_run_that_sampled_nothing_costs_nothing() -> None:
    assert tokens_lost([run(1, 0, 63)], PROMPT) == 0
    assert tokens_generated_again([run(1, 0, 63)], PROMPT) == 0
    runs = [run(1, 0, 9), run(2, None, None)]
    assert tokens_lost(runs, PROMPT) == 0 and tokens_generated_again(runs, PROMPT) == 0


def entries(*events: tuple[int, JobEvent]) -> list[tuple[str, JobEvent]]:
    """Stream entries made at the given milliseconds (the id's first part)."""
    return [(f"{ms}-{seq}", event) for seq, (ms, event) in enumerate(events)]


def tokens_from(start: int, stop: int, ms: int) -> list[tuple[int, JobEvent]]:
    return [(ms + 20 * i, JobEvent.token_event(i, 100 + i, "x")) for i in range(start, stop)]


def test_the_stream_says_what_it_held_when_the_taker_began_and_when_it_went_on() -> None:
    stream = Stream.of(
        entries(
            (1_000, JobEvent.running()),
            *tokens_from(0, 4, 1_010),
            (5_000, JobEvent.running()),
            *tokens_from(4, 8, 5_050 - 80),  # token 4 at 5.050 s
            (6_000, JobEvent.done("succeeded", "length")),
        )
    )
    assert stream.checkpoints == [4]
    assert stream.resumed_at == [5.0]
    assert stream.first_token_at == [pytest.approx(5.05)]
    assert stream.indices == list(range(8))
    assert stream.tokens == [100 + i for i in range(8)]
    assert stream.every_index_once(8)
    assert not stream.every_index_once(9)  # a token missing


def test_a_stream_never_taken_over_or_holding_an_index_twice() -> None:
    once = Stream.of(entries((1_000, JobEvent.running()), *tokens_from(0, 3, 1_010)))
    assert once.checkpoints == [] and once.resumed_at == [] and once.first_token_at == []
    twice = Stream.of(
        entries(
            (1_000, JobEvent.running()),
            *tokens_from(0, 3, 1_010),
            (2_000, JobEvent.running()),  # the taker streamed token 2 again, then stopped
            *tokens_from(2, 3, 2_010),
        )
    )
    assert twice.indices == [0, 1, 2, 2]
    assert not twice.every_index_once(3)
    assert twice.first_token_at == [pytest.approx(2.05)]
    idle = Stream.of(entries((1_000, JobEvent.running()), (2_000, JobEvent.running())))
    assert idle.first_token_at == [None]


def test_the_takeover_time_is_the_taker_s_log_record_of_that_job() -> None:
    records: list[dict[str, Any]] = [
        {"ts": "2026-01-01T00:00:01.000+00:00", "msg": "worker ready"},
        {"ts": "2026-01-01T00:00:02.000+00:00", "msg": TAKEOVER_LOG, "job_id": "other"},
        {"ts": "2026-01-01T00:00:03.250+00:00", "msg": TAKEOVER_LOG, "job_id": "job"},
    ]
    assert takeover_at(records, "job") == pytest.approx(1767225603.25)
    assert takeover_at(records, "missing") is None


def plain(latency_s: float, tokens: list[int] | None = None) -> Uninterrupted:
    return Uninterrupted("a", "w1", latency_s, tokens or [1, 2, 3], True, 1)


def killed(latency_s: float, tokens: list[int] | None = None, lost: int = 0) -> Killed:
    return Killed(
        job_id="b", victim="w2", taker="w1", latency_s=latency_s, tokens=tokens or [1, 2, 3],
        every_index_once=True, runs=2, taker_ran_it=True, streamed_at_kill=32,
        checkpoint_tokens=32, taker_first_token=31, kill_to_resume_s=3.0,
        kill_to_takeover_s=2.5, takeover_to_resume_s=0.5, resume_to_first_token_s=0.05,
        tokens_lost=lost, tokens_generated_again=lost + 1, attempts=2,
    )  # fmt: skip


def test_a_repeat_s_extra_latency_is_the_killed_job_s_less_the_uninterrupted_one_s() -> None:
    found = repeat_figures(plain(1.5), killed(5.25), visibility_timeout_s=2.0)
    assert found["uninterrupted_s"] == 1.5 and found["killed_s"] == 5.25
    assert found["extra_s"] == 3.75
    assert found["extra_less_visibility_s"] == 1.75
    assert found["output_equal"] and found["every_index_once"]
    assert found["runs"] == {"uninterrupted": 1, "killed": 2}
    assert (found["victim"], found["taker"]) == ("w2", "w1")


def test_a_repeat_whose_outputs_or_streams_differ_says_so() -> None:
    assert not repeat_figures(plain(1.0), killed(4.0, [1, 2, 4]), 2.0)["output_equal"]
    # Two empty outputs are equal, and say nothing: not counted as equal.
    assert not repeat_figures(plain(1.0, []), replace(killed(4.0), tokens=[]), 2.0)["output_equal"]
    gap = replace(killed(4.0), every_index_once=False)
    assert not repeat_figures(plain(1.0), gap, 2.0)["every_index_once"]


def test_the_figures_are_each_one_s_median_and_range_and_the_checks_passed() -> None:
    repeats = [
        repeat_figures(plain(1.0), killed(4.0, lost=1), 2.0),
        repeat_figures(plain(2.0), killed(5.0, lost=0), 2.0),
        repeat_figures(plain(1.5), replace(killed(6.0, [9]), kill_to_resume_s=None), 2.0),
    ]
    out = figures(repeats)
    assert out["uninterrupted_s"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert out["extra_s"] == {"median": 3.0, "min": 3.0, "max": 4.5}
    assert out["extra_less_visibility_s"] == {"median": 1.0, "min": 1.0, "max": 2.5}
    assert out["tokens_lost"] == {"median": 0.0, "min": 0.0, "max": 1.0}
    assert out["tokens_generated_again"] == {"median": 1.0, "min": 1.0, "max": 2.0}
    # A repeat that measured no resume is left out of that figure's spread.
    assert out["kill_to_resume_s"] == {"median": 3.0, "min": 3.0, "max": 3.0}
    assert out["killed_over_uninterrupted"] == {"median": 4.0, "min": 2.5, "max": 4.0}
    assert out["checks"] == {
        "repeats": 3,
        "output_equal": 2,
        "every_index_once": 3,
        "taken_over_once": 3,
    }


def test_a_figure_no_repeat_measured_is_nan() -> None:
    repeat = repeat_figures(plain(1.0), replace(killed(4.0), kill_to_takeover_s=None), 2.0)
    assert math.isnan(figures([repeat])["kill_to_takeover_s"]["median"])
