"""The generation benchmark's pure parts (bench/generation_workload.py): the workload it
draws and the figures it computes from what each request recorded."""

from __future__ import annotations

import math
import statistics

import pytest

from bench.generation_workload import (
    OUTPUTS,
    PROMPTS,
    ChunkedLoad,
    Lengths,
    Record,
    Request,
    arriving,
    decoders_figures,
    draw_workload,
    gaps_ms,
    poisson_arrivals,
    ratio_spread,
    static_batches,
    summary,
)
from bench.quantiles import quantile

CORPUS = list(range(5000))  # token i at position i: a prompt's window is easy to check


def test_the_workload_is_seeded_and_its_prompts_are_windows_of_the_corpus() -> None:
    first = draw_workload(CORPUS, 200, seed=3)
    assert first == draw_workload(CORPUS, 200, seed=3)
    assert first != draw_workload(CORPUS, 200, seed=4)
    for request in first:
        ids = request.prompt_ids
        assert list(ids) == list(range(ids[0], ids[0] + len(ids)))  # contiguous in the corpus
        assert PROMPTS.low <= len(ids) <= PROMPTS.high
        assert OUTPUTS.low <= request.max_tokens <= OUTPUTS.high
        assert request.arrival_s == 0.0
    assert len({r.id for r in first}) == 200


def test_the_lengths_are_skewed_most_short_some_long() -> None:
    drawn = draw_workload(CORPUS, 2000, seed=0)
    prompts = [len(r.prompt_ids) for r in drawn]
    outputs = [r.max_tokens for r in drawn]
    for values, lengths in ((prompts, PROMPTS), (outputs, OUTPUTS)):
        median = statistics.median(values)
        assert 0.8 * lengths.median <= median <= 1.2 * lengths.median
        assert statistics.fmean(values) > 1.3 * median  # a right tail pulls the mean up
        assert max(values) > 8 * median
    assert sum(p > 256 for p in prompts) > 0.04 * len(prompts)
    assert sum(o > 128 for o in outputs) > 0.02 * len(outputs)


def test_a_length_is_clipped_to_its_range() -> None:
    import random

    wide = Lengths(median=50.0, sigma=5.0, low=4, high=60)
    rng = random.Random(0)
    drawn = [wide.draw(rng) for _ in range(500)]
    assert min(drawn) == 4 and max(drawn) == 60


def test_a_corpus_shorter_than_the_longest_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="corpus"):
        draw_workload(list(range(500)), 10, seed=0)


def test_poisson_arrivals_start_at_zero_and_average_the_rate() -> None:
    times = poisson_arrivals(4000, rate_per_s=20.0, seed=1)
    assert times[0] == 0.0
    assert times == sorted(times)
    assert times == poisson_arrivals(4000, rate_per_s=20.0, seed=1)
    mean_gap = times[-1] / (len(times) - 1)
    assert mean_gap == pytest.approx(1 / 20.0, rel=0.05)
    with pytest.raises(ValueError):
        poisson_arrivals(3, rate_per_s=0.0, seed=1)


def test_static_batches_group_in_arrival_order() -> None:
    base = draw_workload(CORPUS, 10, seed=0)
    late_first = arriving(base, [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    batches = static_batches(late_first, 4)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [r.id for r in batches[0]] == ["r9", "r8", "r7", "r6"]
    assert [r.arrival_s for b in batches for r in b] == sorted(r.arrival_s for r in late_first)
    assert [len(b) for b in static_batches(base, 1)] == [1] * 10
    with pytest.raises(ValueError):
        static_batches(base, 0)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0.5, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),
        ([5.0, 1.0, 3.0], 0.0, 1.0),
        ([5.0, 1.0, 3.0], 1.0, 5.0),
        (list(map(float, range(101))), 0.99, 99.0),
        ([1.0, 100.0], 0.99, 99.01),
        ([7.0], 0.99, 7.0),
    ],
)
def test_quantiles(values: list[float], q: float, expected: float) -> None:
    assert quantile(values, q) == pytest.approx(expected)


def test_the_quantile_of_nothing_is_nan() -> None:
    assert math.isnan(quantile([], 0.5))


def test_a_record_gives_ttft_from_arrival_and_tpot_after_the_first_token() -> None:
    record = Record(arrival_s=1.0, first_s=1.25, last_s=2.25, tokens=11)
    assert record.ttft_s == pytest.approx(0.25)
    assert record.tpot_s == pytest.approx(0.1)
    assert Record(0.0, 0.5, 0.5, 1).tpot_s is None


def test_a_runs_summary_counts_tokens_over_its_span() -> None:
    records = [
        Record(arrival_s=0.0, first_s=0.1, last_s=1.0, tokens=10),
        Record(arrival_s=0.5, first_s=0.7, last_s=2.0, tokens=14),
        Record(arrival_s=1.0, first_s=1.4, last_s=1.4, tokens=1),  # no TPOT
    ]
    found = summary(records)
    assert found["output_tokens"] == 25
    assert found["span_s"] == pytest.approx(2.0)  # first arrival to last token
    assert found["tokens_per_s"] == pytest.approx(12.5)
    assert found["ttft_p50_ms"] == pytest.approx(200.0)
    assert found["ttft_p99_ms"] == pytest.approx(200.0 + (400.0 - 200.0) * 0.98)
    assert found["tpot_p50_ms"] == pytest.approx((100.0 + 1300.0 / 13) / 2)
    with pytest.raises(ValueError):
        summary([])


def test_ratios_pair_the_rounds_that_ran_side_by_side() -> None:
    found = ratio_spread([100.0, 90.0, 120.0], [50.0, 60.0, 40.0])
    assert found == {"median": 2.0, "min": 1.5, "max": 3.0}
    assert math.isnan(ratio_spread([1.0], [0.0])["median"])
    with pytest.raises(ValueError):
        ratio_spread([1.0, 2.0], [1.0])


def test_a_stall_shows_as_one_long_gap() -> None:
    assert gaps_ms([0.0, 0.01, 0.02, 0.52, 0.53]) == pytest.approx([10.0, 10.0, 500.0, 10.0])
    assert gaps_ms([1.0]) == []


def test_the_chunked_load_puts_long_prompts_among_running_decodes() -> None:
    load = ChunkedLoad(decoders=3, decoder_tokens=20, long_prompts=2, long_prompt=900)
    drawn = load.draw(CORPUS, seed=0)
    decoders = [r for r in drawn if r.id.startswith("d")]
    long = [r for r in drawn if r.id.startswith("l")]
    assert [r.arrival_s for r in decoders] == [0.0] * 3
    assert [r.arrival_s for r in long] == [load.every_s, 2 * load.every_s]
    assert {len(r.prompt_ids) for r in long} == {900}
    times = {
        "d0": [0.0, 0.01, 0.02, 0.30, 0.31],
        "d1": [0.0, 0.01, 0.02, 0.30, 0.31],
        "l0": [0.30],
    }
    records = {
        "d0": Record(0.0, 0.0, 0.31, 5),
        "d1": Record(0.0, 0.0, 0.31, 5),
        "l0": Record(0.1, 0.30, 0.30, 1),
    }
    found = decoders_figures(times, records)
    assert found["decode_gap_max_ms"] == pytest.approx(280.0)
    assert found["decode_gap_p50_ms"] == pytest.approx(10.0)
    assert found["decode_tpot_p99_ms"] == pytest.approx(77.5)
    assert found["long_ttft_p50_ms"] == pytest.approx(200.0)


def test_a_request_keeps_its_prompt_when_it_is_given_an_arrival() -> None:
    request = Request("a", (1, 2, 3), 4)
    (moved,) = arriving([request], [2.5])
    assert moved == Request("a", (1, 2, 3), 4, 2.5)
    with pytest.raises(ValueError):
        arriving([request], [1.0, 2.0])
