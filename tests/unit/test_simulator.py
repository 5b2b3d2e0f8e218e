"""The scheduler simulator's bookkeeping on short synthetic traces, and the corpus."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from bench import simulate as sim
from bench.corpus import MAX_TOKENS, load_corpus
from scheduler import PolicyKind
from scheduler.learning import Tuning

COSTS = tuple(random.Random(7).choice([8, 12, 20, 35, 60, 120, 256]) for _ in range(500))
MODEL = sim.GpuModel("test-gpu", fixed_s=0.002, per_token_s=1e-6)


def ferry() -> sim.Policy:
    return sim.ferry_policy(
        # The window and ride bounds these tests were written for (not the shipped defaults).
        Tuning(
            batch_max_size=64,
            batch_max_cost=4096,
            padded=True,
            batch_window_max_ms=50.0,
            bulk_ride_factor=math.inf,
        )
    )


def policies() -> list[sim.Policy]:
    return [sim.single_policy(), sim.fixed_policy(32, 0.005), ferry()]


def trace(kind: str = "poisson", rate: float = 3000.0, n: int = 1500) -> list[sim.Job]:
    return sim.make_trace(kind, rate, n, COSTS, seed=3)


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
@pytest.mark.parametrize("kind", ["uniform", "poisson", "bursty"])
def test_every_job_gets_exactly_one_outcome(policy: sim.Policy, kind: str) -> None:
    jobs = trace(kind)
    result = sim.simulate(jobs, policy, MODEL, prefetch=64)
    assert sim.PENDING not in result.outcome
    assert all(math.isfinite(t) for t in result.finish_s)
    ran = [int(key) for b in result.batches for key in b.keys]
    expired = [i for i, o in enumerate(result.outcome) if o == sim.EXPIRED]
    assert sorted(ran + expired) == list(range(len(jobs)))  # none twice, none lost
    for job in jobs:
        finish, outcome = result.finish_s[job.index], result.outcome[job.index]
        assert finish >= job.arrival_s
        if outcome != sim.EXPIRED:
            late = job.deadline_s is not None and finish > job.deadline_s
            assert outcome == (sim.LATE if late else sim.ON_TIME)


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_the_virtual_clock_never_goes_backwards_and_batches_never_overlap(
    policy: sim.Policy,
) -> None:
    result = sim.simulate(trace(), policy, MODEL, prefetch=64, trace_clock=True)
    assert result.clock == sorted(result.clock)
    assert len(result.clock) >= len(result.jobs)
    for before, after in itertools.pairwise(result.batches):
        assert before.end_s <= after.start_s  # one GPU, one batch at a time
        assert before.start_s < before.end_s


def test_a_batch_prepared_ahead_starts_the_moment_the_device_is_free() -> None:
    jobs = trace(rate=20_000.0, n=3000)
    plain = sim.simulate(jobs, ferry(), MODEL, prefetch=64)
    ahead = sim.simulate(jobs, ferry(), MODEL, prefetch=64, prepare_ahead=True)
    for result in (plain, ahead):
        assert sim.PENDING not in result.outcome
        ran = sorted(int(key) for b in result.batches for key in b.keys)
        expired = [i for i, o in enumerate(result.outcome) if o == sim.EXPIRED]
        assert sorted(ran + expired) == list(range(len(jobs)))  # none twice, none lost
        for before, after in itertools.pairwise(result.batches):
            assert before.end_s <= after.start_s  # still one batch at a time

    # Without it every batch is decided when it starts; with it, under
    # overload, most are decided while the one before computes, from the jobs
    # that had arrived by then, and only for a reason waiting cannot change.
    assert all(b.decided_s == b.start_s for b in plain.batches)
    early = [b for b in ahead.batches if b.decided_s < b.start_s]
    assert len(early) >= len(ahead.batches) // 2
    for batch in early:
        assert all(jobs[int(key)].arrival_s <= batch.decided_s for key in batch.keys)
        assert batch.trigger not in ("time", "idle")


def test_two_servers_share_the_streams_and_each_runs_one_batch_at_a_time() -> None:
    jobs = trace(rate=800.0, n=1500)
    one = sim.simulate(jobs, sim.single_policy(), MODEL, servers=1)
    two = sim.simulate(jobs, sim.single_policy(), MODEL, servers=2)
    assert {b.worker for b in two.batches} == {0, 1}
    for worker in (0, 1):
        mine = [b for b in two.batches if b.worker == worker]
        for before, after in itertools.pairwise(mine):
            assert before.end_s <= after.start_s
    # 800 jobs/s overloads one unbatched GPU (about 490/s) but not two.
    assert not sim.sustainable(one)
    assert sim.sustainable(two)


def test_no_batching_runs_one_job_at_a_time_in_arrival_order() -> None:
    jobs = trace(rate=300.0, n=400)
    result = sim.simulate(jobs, sim.single_policy(), MODEL)
    assert {b.size for b in result.batches} == {1}
    started = [int(b.keys[0]) for b in result.batches]
    assert started == sorted(started)


def test_fixed_batching_never_exceeds_its_size_and_fills_under_load() -> None:
    result = sim.simulate(trace(rate=20_000.0, n=3000), sim.fixed_policy(32, 0.005), MODEL)
    sizes = [b.size for b in result.batches]
    assert max(sizes) == 32
    assert all(1 <= size <= 32 for size in sizes)


def test_fixed_batching_waits_at_most_its_delay_when_idle() -> None:
    # Sparse arrivals: each job waits out the 5 ms delay, then runs alone.
    jobs = trace("uniform", rate=50.0, n=50)
    result = sim.simulate(jobs, sim.fixed_policy(32, 0.005), MODEL)
    for b in result.batches:
        oldest = min(jobs[int(key)].arrival_s for key in b.keys)
        assert b.start_s - oldest == pytest.approx(0.005, abs=1e-5)


def test_ferry_respects_its_batch_limits_and_learns_the_model() -> None:
    policy = ferry()
    assert policy.batcher.kind is PolicyKind.FERRY
    result = sim.simulate(trace(rate=8000.0, n=4000), policy, MODEL)
    for b in result.batches:
        assert b.size <= 64
        assert b.size == 1 or b.size * b.max_cost <= 4096
    fit = policy.state.latency.fit()
    assert fit.intercept == pytest.approx(MODEL.fixed_s, rel=0.2)
    assert fit.slope == pytest.approx(MODEL.per_token_s, rel=0.2)


def test_deadlines_are_lane_relative_and_bulk_has_none() -> None:
    mix = {"urgent": 0.25, "vip": 0.25, "normal": 0.25, "bulk": 0.25}
    jobs = sim.make_trace("poisson", 1000.0, 400, COSTS, seed=1, mix=mix)
    assert {j.lane for j in jobs} == set(mix)
    for job in jobs:
        limit = sim.DEFAULT_DEADLINES[job.lane]
        if limit is None:
            assert job.deadline_s is None
        else:
            assert job.deadline_s == pytest.approx(job.arrival_s + limit)


@pytest.mark.parametrize("kind", ["uniform", "poisson", "bursty"])
def test_traces_have_the_asked_rate_and_a_paired_pattern(kind: str) -> None:
    jobs = sim.make_trace(kind, 2000.0, 20_000, COSTS, seed=5)
    arrivals = [j.arrival_s for j in jobs]
    assert arrivals == sorted(arrivals)
    # On/off periods make the bursty trace's rate over 10 s vary by some 20 %.
    tolerance = 0.35 if kind == "bursty" else 0.03
    assert len(jobs) / arrivals[-1] == pytest.approx(2000.0, rel=tolerance)
    # Same seed, another rate: the same lanes and costs (common random numbers).
    other = sim.make_trace(kind, 500.0, 20_000, COSTS, seed=5)
    assert [(j.lane, j.cost) for j in other] == [(j.lane, j.cost) for j in jobs]


def test_bursty_arrivals_are_burstier_than_poisson() -> None:
    def dispersion(kind: str) -> float:
        jobs = sim.make_trace(kind, 2000.0, 20_000, COSTS, seed=5)
        bins = [0] * (int(jobs[-1].arrival_s / 0.01) + 1)
        for job in jobs:
            bins[int(job.arrival_s / 0.01)] += 1
        mean = sum(bins) / len(bins)
        return sum((b - mean) ** 2 for b in bins) / len(bins) / mean  # 1 for Poisson

    assert dispersion("uniform") < 0.1
    assert 0.8 < dispersion("poisson") < 1.2
    assert dispersion("bursty") > 3.0


def test_an_overloaded_run_is_not_sustainable_and_a_light_one_is() -> None:
    light = sim.simulate(trace(rate=100.0, n=600), sim.single_policy(), MODEL)
    heavy = sim.simulate(trace(rate=2000.0, n=3000), sim.single_policy(), MODEL)
    assert sim.sustainable(light)
    assert not sim.sustainable(heavy)
    assert sim.backlog_growing(heavy)


def test_summary_counts_misses_and_efficiency() -> None:
    result = sim.simulate(trace(rate=20_000.0, n=3000), sim.fixed_policy(32, 0.005), MODEL)
    summary = sim.summarize(result)
    assert 0 < summary["efficiency_mean"] <= 1
    assert 0 < summary["efficiency_cost_weighted"] <= 1
    assert summary["miss_rate"] > 0  # 20k/s is far past what fixed batching sustains
    assert summary["lanes"]["normal"]["p50_ms"] <= summary["lanes"]["normal"]["p99_ms"]


def test_corpus_is_real_sentences_with_minilm_token_costs() -> None:
    corpus = load_corpus(seed=0, max_files=40)
    assert len(corpus.texts) >= 50
    assert len(corpus.texts) == len(corpus.costs) == len(set(corpus.texts))
    assert all(1 <= cost <= MAX_TOKENS for cost in corpus.costs)
    for text, cost in zip(corpus.texts[:20], corpus.costs[:20], strict=True):
        assert text[0].isupper() and text.endswith((".", "!", "?"))
        assert len(text.split()) >= 6
        # Word pieces plus [CLS] and [SEP]: at least one token a word, give or take.
        assert cost >= min(len(text.split()) // 2, MAX_TOKENS)
    # Reproducible: the same seed gives the same order.
    assert load_corpus(seed=0, max_files=40).texts == corpus.texts
