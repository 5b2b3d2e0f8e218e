"""The durable-generation benchmark's pure parts (bench/generation_promises.py): its loads,
its comparison scheduler, and the figures it computes from what each run recorded."""

from __future__ import annotations

import random

import pytest

from bench.generation_promises import (
    SMOKE,
    Job,
    NoPreemption,
    Shape,
    StepSeen,
    Trace,
    _split_over,
    checkpoint_round,
    fairness_load,
    figures,
    preemption_load,
    preemption_round,
    split_load,
    weighted_share,
)
from scheduler.generation import (
    GenerationLimits,
    GenerationRequest,
    GenerationScheduler,
    Lane,
    StepOutput,
)

CORPUS = list(range(5000))


def test_the_comparison_scheduler_never_preempts_for_an_urgent_request_and_ferrys_does() -> None:
    limits = GenerationLimits(kv_blocks=8, block_size=4, max_running=4, step_tokens=32)

    def urgent_start(kind: type[GenerationScheduler]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        scheduler = kind(limits)
        for i in range(2):  # two bulk ones hold the whole pool (four blocks each)
            scheduler.add(GenerationRequest(f"b{i}", 4, 12, Lane.BULK))
        plan = scheduler.schedule(0.0)
        scheduler.update_from_output(plan, StepOutput({i: 1 for i in plan.sampling}, {}, 0.01), 0)
        scheduler.add(GenerationRequest("u", 4, 4, Lane.URGENT))
        plan = scheduler.schedule(1.0)
        return plan.admitted, plan.preempted

    assert urgent_start(GenerationScheduler) == (("u",), ("b1",))
    assert urgent_start(NoPreemption) == ((), ())


def test_the_loads_are_seeded_and_the_light_keys_requests_are_the_same_with_a_flood() -> None:
    shape = Shape(light_rate=5.0, light_s=4.0, flood_factor=10.0)
    idle = fairness_load(CORPUS, shape, 1, flood=False)
    flooded = fairness_load(CORPUS, shape, 1, flood=True)
    assert idle == fairness_load(CORPUS, shape, 1, flood=False)
    assert [j for j in flooded if j.tenant == "light"] == idle
    floods = [j for j in flooded if j.tenant == "flood"]
    # About ten times the light key's rate, all within the window, long generations.
    assert 5 * len(idle) <= len(floods) <= 20 * len(idle)
    assert all(0 <= j.arrival_s < shape.light_s for j in flooded)
    assert {j.max_tokens for j in floods} == {shape.flood_tokens}
    jobs = preemption_load(CORPUS, SMOKE, 2)
    urgent = [j for j in jobs if j.lane is Lane.URGENT]
    assert len(urgent) == SMOKE.urgent and all(j.arrival_s > 0 for j in urgent)
    assert all(j.arrival_s == 0 for j in jobs if j.lane is Lane.BULK)
    weights = {(j.tenant, j.weight) for j in split_load(CORPUS, SMOKE, 3)}
    assert weights == {("heavy", 3.0), ("light", 1.0)}


def test_a_share_is_weighed_by_each_steps_duration() -> None:
    steps = [
        StepSeen(0.0, 1.0, {"a": 3, "b": 1}, {"a": 1}),  # a holds 3/4 for 1 s
        StepSeen(1.0, 4.0, {"a": 1, "b": 1}, {"a": 1, "b": 1}),  # 1/2 for 3 s
        StepSeen(4.0, 9.0, {}, {}),  # nothing held: not counted
    ]
    assert weighted_share(steps, "a", "blocks") == pytest.approx((0.75 + 3 * 0.5) / 4)
    assert weighted_share(steps, "a", "tokens") == pytest.approx((1.0 + 3 * 0.5) / 4)
    assert weighted_share(steps, "c", "blocks") == 0.0


def trace(
    first: dict[str, float],
    end: dict[str, float],
    tokens: dict[str, list[int]],
    preempted: dict[str, int] | None = None,
) -> Trace:
    return Trace(
        arrived_step={i: 0 for i in first},
        first_s=first,
        first_step={i: 1 for i in first},
        end_s=end,
        tokens=tokens,
        preempted=preempted or {},
    )


def test_preemption_figures_count_what_the_preempted_jobs_lost_and_the_urgent_ones_gained() -> None:
    jobs = [
        Job("u0", (1,), 2, 1.0, Lane.URGENT),
        Job("b0", (1,), 3, 0.0, Lane.BULK),
        Job("b1", (1,), 3, 0.0, Lane.BULK),
        Job("b2", (1,), 3, 0.0, Lane.BULK),
    ]
    ferry = trace(
        {"u0": 1.1, "b0": 0.1, "b1": 0.1, "b2": 0.1},
        {"u0": 1.2, "b0": 3.0, "b1": 2.5, "b2": 2.0},
        # b0 preempted, resumed, same tokens; b1 preempted and started over (six tokens).
        {"u0": [5, 6], "b0": [1, 2, 3], "b1": [1, 2, 3, 1, 2, 3], "b2": [7, 8, 9]},
        {"b0": 1, "b1": 2},
    )
    without = trace(
        {"u0": 2.0, "b0": 0.1, "b1": 0.1, "b2": 0.1},
        {"u0": 2.1, "b0": 2.0, "b1": 2.0, "b2": 2.0},
        {"u0": [5, 6], "b0": [1, 2, 3], "b1": [1, 2, 3], "b2": [7, 8, 9]},
    )
    got = preemption_round(ferry, without, jobs)
    assert got["urgent_ttft_ms"]["preemption"]["p99"] == pytest.approx(100.0)
    assert got["urgent_ttft_ms"]["no_preemption"]["p99"] == pytest.approx(1000.0)
    assert got["preempted_jobs"] == 2 and got["preemptions"] == 3
    assert got["preempted_delay_ms"]["max"] == pytest.approx(1000.0)  # b0 ended 1 s later
    assert got["preempted_outputs_equal"] == 1 and got["restarted_from_zero"] == 1
    rounds = [
        {
            "preemption": got,
            "fairness": {
                "light_ttft_ms": {"idle": {"p99": 10.0}, "flood": {"p99": 12.0}},
                "light_ttft_steps": {"idle": {"p99": 1.0}, "flood": {"p99": 2.0}},
                "flood_kv_share": 0.9,
                "step_ms": {"idle": 10.0, "flood": 30.0},
            },
            "split": {"heavy_kv_share": 0.74, "heavy_token_share": 0.7},
            # Each trial's cost against its own run without writes, the median over trials:
            # 3 %, 10 % and 1 % with; 10 %, 5 % and 20 % in the loop.
            "checkpoint": checkpoint_round(
                [
                    {"with": 97.0, "without": 100.0, "in_loop": 90.0},
                    {"with": 81.0, "without": 90.0, "in_loop": 85.5},
                    {"with": 99.0, "without": 100.0, "in_loop": 80.0},
                ],
                appended=0,
            ),
        }
    ]
    summary = figures(rounds)
    assert summary["urgent_ttft_gain"]["median"] == pytest.approx(10.0)
    assert summary["light_ttft_p99_ratio"]["median"] == pytest.approx(1.2)
    assert summary["step_ms_ratio"]["median"] == pytest.approx(3.0)
    assert summary["checkpoint_cost"]["median"] == pytest.approx(0.03)
    assert summary["checkpoint_cost_in_loop"]["median"] == pytest.approx(0.1)
    assert summary["heavy_kv_share"]["median"] == pytest.approx(0.74)
    assert summary["restarted_from_zero"] == 1


def test_the_flood_key_arrives_at_its_factor_of_the_light_keys_rate() -> None:
    rng = random.Random(0)
    shape = Shape(light_rate=2.0, light_s=200.0, flood_factor=50.0)
    jobs = fairness_load(CORPUS, shape, rng.randrange(100), flood=True)
    light = sum(1 for j in jobs if j.tenant == "light")
    flood = sum(1 for j in jobs if j.tenant == "flood")
    assert flood / light == pytest.approx(50.0, rel=0.15)


def test_the_split_ends_once_a_key_has_nothing_waiting_or_at_its_time() -> None:
    jobs = split_load(CORPUS, SMOKE, seed=3)
    over = _split_over(jobs, seconds=10.0)
    trace = Trace()
    assert not over(trace, 1.0)
    heavy = [j.id for j in jobs if j.tenant == "heavy"]
    light = [j.id for j in jobs if j.tenant == "light"]
    for id in heavy[:-1] + light[:1]:
        trace.first_s[id] = 0.5
    assert not over(trace, 1.0)  # both keys still have one waiting
    trace.first_s[heavy[-1]] = 0.6
    assert over(trace, 1.0)  # every heavy job started: its share is no longer chosen
    assert _split_over(jobs, seconds=10.0)(Trace(), 10.0)
