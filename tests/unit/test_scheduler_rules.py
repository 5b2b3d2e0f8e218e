"""Each rule of the scheduler (docs/architecture.md §5), as tables of cases on the pure policy."""

from __future__ import annotations

import math

import pytest

from scheduler.baselines import decide_fixed, decide_single
from scheduler.learning import BatchObservation, OnlineFit, SchedulerState, Tuning
from scheduler.policy import INF, LinearFit, PendingItem, Profile, decide, efficiency


def item(
    key: str,
    lane: str = "normal",
    cost: int = 10,
    arrival_s: float = 0.0,
    deadline_s: float | None = None,
) -> PendingItem:
    return PendingItem(key=key, lane=lane, cost=cost, arrival_s=arrival_s, deadline_s=deadline_s)


def keys(items: tuple[PendingItem, ...]) -> list[str]:
    return [i.key for i in items]


def profile(**overrides: object) -> Profile:
    base: dict[str, object] = {"max_batch_size": 8, "window_s": 1.0}
    base.update(overrides)
    return Profile(**base)  # type: ignore[arg-type]


# --- triggers ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pending", "prof", "now", "trigger", "ran"),
    [
        # count: the batch is full
        ([item(str(i)) for i in range(8)], profile(), 0.1, "size", 8),
        ([item(str(i)) for i in range(7)], profile(), 0.1, None, 0),
        # cost: the work cap is reached before the count cap (unpadded: sum of costs)
        ([item(str(i), cost=30) for i in range(4)], profile(max_batch_cost=100), 0.1, "cost", 3),
        # cost: the load-driven target is already pending, so waiting gains nothing
        ([item(str(i), cost=10) for i in range(3)], profile(target_cost=30), 0.1, "cost", 3),
        ([item(str(i), cost=10) for i in range(2)], profile(target_cost=30), 0.1, None, 0),
        # memory: 100 MB + 10 MB per cost, limit 500 MB -> at most 40 cost
        (
            [item(str(i), cost=15) for i in range(4)],
            profile(memory=LinearFit(100e6, 10e6), memory_limit=500e6),
            0.1,
            "memory",
            2,
        ),
        # time: the oldest waited the window
        ([item("a", arrival_s=0.0)], profile(window_s=0.5), 0.5, "time", 1),
        ([item("a", arrival_s=0.0)], profile(window_s=0.5), 0.49, None, 0),
        # deadline: 0.3 s of batch latency leaves no slack to wait out the window
        (
            [item("a", deadline_s=0.7)],
            profile(window_s=0.5, latency=LinearFit(0.3, 0.0)),
            0.25,
            "deadline",
            1,
        ),
        (
            [item("a", deadline_s=2.0)],
            profile(window_s=0.5, latency=LinearFit(0.3, 0.0)),
            0.1,
            None,
            0,
        ),
        # urgent: dispatch at once, whatever the window
        ([item("n"), item("u", "urgent")], profile(window_s=10.0), 0.0, "urgent", 2),
        # idle: a lone item at low load does not wait for company
        ([item("a")], profile(window_s=10.0, idle=True), 0.0, "idle", 1),
        ([item("a"), item("b")], profile(window_s=10.0, idle=True), 0.0, None, 0),
        ([item("a")], profile(window_s=10.0, idle=False), 0.0, None, 0),
    ],
)
def test_triggers(
    pending: list[PendingItem], prof: Profile, now: float, trigger: str | None, ran: int
) -> None:
    decision = decide(pending, prof, now)
    assert decision.trigger == trigger
    assert len(decision.run) == ran
    if trigger is None:
        assert decision.wait_s is not None and decision.wait_s > 0


def test_memory_cut_is_before_the_item_that_would_cross() -> None:
    # 1 MB per cost, limit 100 MB: 30 + 40 fit (70 MB), the next 40 would cross.
    pending = [item("a", cost=30), item("b", cost=40), item("c", cost=40), item("d", cost=5)]
    prof = profile(memory=LinearFit(0.0, 1e6), memory_limit=100e6)
    decision = decide(pending, prof, 0.0)
    assert decision.trigger == "memory"
    assert keys(decision.run) == ["a", "b"]  # no overtaking: d waits behind c


def test_one_item_runs_even_when_predicted_over_every_limit() -> None:
    prof = profile(max_batch_cost=10, memory=LinearFit(0.0, 1.0), memory_limit=5)
    decision = decide([item("big", cost=500)], prof, 5.0)
    assert keys(decision.run) == ["big"]


def test_wait_is_until_the_window_or_the_deadline_slack() -> None:
    prof = profile(window_s=0.5, latency=LinearFit(0.1, 0.0))
    assert decide([item("a", arrival_s=1.0)], prof, 1.2).wait_s == pytest.approx(0.3)
    # deadline 2.0 - latency 0.1 - now 1.2: slack 0.7, the window ends first
    assert decide([item("a", arrival_s=1.0, deadline_s=2.0)], prof, 1.2).wait_s == pytest.approx(
        0.3
    )


# --- expiry ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("deadline_s", "latency", "now", "expired"),
    [
        (10.0, LinearFit(), 10.0, True),  # passed
        (10.0, LinearFit(), 9.9, False),
        (10.0, LinearFit(0.5, 0.0), 9.6, True),  # cannot finish: 9.6 + 0.5 > 10
        (10.0, LinearFit(0.5, 0.0), 9.4, False),
        (10.0, LinearFit(0.0, 0.01), 9.95, True),  # 10 cost x 10 ms: too late
        (None, LinearFit(5.0, 0.0), 1e9, False),
    ],
)
def test_items_that_cannot_finish_in_time_expire(
    deadline_s: float | None, latency: LinearFit, now: float, expired: bool
) -> None:
    decision = decide([item("x", deadline_s=deadline_s)], profile(latency=latency), now)
    assert keys(decision.expire) == (["x"] if expired else [])


# --- order, lanes, fairness --------------------------------------------------------


def test_order_is_lane_then_deadline_then_arrival() -> None:
    pending = [
        item("bulk", "bulk", arrival_s=0.0),
        item("n-late", arrival_s=0.1),
        item("n-early", arrival_s=0.2),
        item("n-deadline", arrival_s=0.3, deadline_s=50.0),
        item("vip", "vip", arrival_s=0.4),
    ]
    decision = decide(pending, profile(max_batch_size=3, window_s=0.0), 1.0)
    assert keys(decision.run) == ["vip", "n-deadline", "n-late"]


def test_a_lower_lane_never_overtakes_a_higher_one() -> None:
    # The normal lane does not fit: vip is cut, and no normal item may join.
    pending = [item(f"v{i}", "vip", cost=10) for i in range(6)] + [item("n", cost=10)]
    decision = decide(pending, profile(max_batch_size=4, window_s=0.0), 1.0)
    assert {i.lane for i in decision.run} == {"vip"}


def test_bulk_keeps_its_share_when_interactive_lanes_overflow() -> None:
    pending = [item(f"n{i}", cost=10) for i in range(20)] + [
        item(f"b{i}", "bulk", cost=10) for i in range(20)
    ]
    decision = decide(pending, profile(max_batch_size=8, window_s=0.0, bulk_slots=2), 1.0)
    lanes = [i.lane for i in decision.run]
    assert lanes.count("bulk") == 2 and lanes.count("normal") == 6


def test_bulk_slots_are_not_held_back_when_bulk_is_empty() -> None:
    pending = [item(f"n{i}", cost=10) for i in range(20)]
    decision = decide(pending, profile(max_batch_size=8, window_s=0.0, bulk_slots=2), 1.0)
    assert len(decision.run) == 8


def test_bulk_fills_what_the_interactive_lanes_leave() -> None:
    pending = [item("n0"), item("n1")] + [item(f"b{i}", "bulk") for i in range(10)]
    decision = decide(pending, profile(max_batch_size=8, window_s=0.0), 1.0)
    assert [i.lane for i in decision.run] == ["normal"] * 2 + ["bulk"] * 6


# --- cost-aware grouping --------------------------------------------------------------


def test_a_padded_model_groups_similar_costs() -> None:
    # 8 short and 8 long texts interleaved, room for 8: the head (short) and its
    # kind run together rather than short ones padded to the long ones' length.
    pending = [
        item(f"{'s' if i % 2 == 0 else 'l'}{i}", cost=12 if i % 2 == 0 else 200, arrival_s=i)
        for i in range(16)
    ]
    prof = profile(window_s=0.0, padded=True, latency=LinearFit(0.002, 1e-6))
    decision = decide(pending, prof, 100.0)
    assert {i.cost for i in decision.run} == {12}
    assert len(decision.run) == 8
    assert decision.run[0].key == "s0"  # the head of the lane is always in


def test_the_head_of_the_lane_always_runs_even_when_it_is_the_odd_one() -> None:
    pending = [item("long", cost=250, arrival_s=0.0)] + [
        item(f"s{i}", cost=10, arrival_s=1.0 + i) for i in range(20)
    ]
    prof = profile(window_s=0.0, padded=True, latency=LinearFit(0.002, 1e-6))
    assert "long" in keys(decide(pending, prof, 100.0).run)


def test_grouping_does_not_split_when_the_fixed_cost_dominates() -> None:
    # 5 ms per batch and next to nothing per token: one batch beats two.
    pending = [item("a", cost=10), item("b", cost=12), item("c", cost=100)]
    prof = profile(window_s=0.0, padded=True, latency=LinearFit(0.005, 1e-9))
    assert len(decide(pending, prof, 1.0).run) == 3


@pytest.mark.parametrize(
    ("costs", "expected"),
    [([10, 10, 10], 1.0), ([10, 20], 0.75), ([1, 100], 0.505), ([], 1.0), ([7], 1.0)],
)
def test_efficiency(costs: list[int], expected: float) -> None:
    assert efficiency(costs) == pytest.approx(expected)


def test_padded_work_is_count_times_the_longest() -> None:
    prof = profile(padded=True, max_batch_cost=100)
    # 3 items padded to 40 = 120 work > 100: only two fit.
    pending = [item("a", cost=10), item("b", cost=40), item("c", cost=10)]
    decision = decide(pending, prof, 5.0)
    assert len(decision.run) == 2 and decision.trigger == "cost"


# --- learning ---------------------------------------------------------------------


def test_online_fit_recovers_a_line() -> None:
    fit = OnlineFit(forget=1.0)
    for x in (10, 100, 1000, 50, 500):
        fit.observe(x, 0.004 + 2e-6 * x)
    line = fit.fit()
    assert line.intercept == pytest.approx(0.004, rel=1e-6)
    assert line.slope == pytest.approx(2e-6, rel=1e-6)


def test_online_fit_follows_a_change_and_keeps_coefficients_non_negative() -> None:
    fit = OnlineFit(LinearFit(0.010, 0.0), forget=0.8)
    for _ in range(60):
        for x in (100.0, 400.0):
            fit.observe(x, 0.001 + 1e-5 * x)
    line = fit.fit()
    assert line(250.0) == pytest.approx(0.001 + 1e-5 * 250, rel=0.05)
    falling = OnlineFit(forget=1.0)
    falling.observe(1.0, 1.0)
    falling.observe(2.0, 0.5)
    assert falling.fit().slope >= 0 and falling.fit().intercept >= 0


def test_online_fit_without_spread_keeps_the_prior_slope() -> None:
    fit = OnlineFit(LinearFit(0.0, 0.5), forget=0.5)
    for _ in range(40):
        fit.observe(10.0, 6.0)
    line = fit.fit()
    assert line.slope == pytest.approx(0.5)
    assert line(10.0) == pytest.approx(6.0, rel=1e-3)


def observation(latency_s: float, job_latency_s: float, ended_s: float = 0.0) -> BatchObservation:
    return BatchObservation(
        size=4, cost=40, work=40, latency_s=latency_s, ended_s=ended_s,
        job_latency_s=[job_latency_s] * 4,
    )  # fmt: skip


def test_the_window_starts_at_one_and_a_half_batch_latencies() -> None:
    state = SchedulerState.create(Tuning(batch_window_max_ms=1000))
    state.observe_batch(observation(0.020, 0.030))
    assert state.window_s == pytest.approx(0.030)


@pytest.mark.parametrize(
    ("job_latency_s", "factor"),
    [(0.200, 0.8), (0.121, 0.8), (0.119, 1.0), (0.081, 1.0), (0.079, 1.2), (0.010, 1.2)],
)
def test_the_window_adapts_to_the_latency_target(job_latency_s: float, factor: float) -> None:
    state = SchedulerState.create(Tuning(batch_window_max_ms=1000, latency_target_ms=100))
    state.observe_batch(observation(0.020, 0.100))
    before = state.window_s
    assert before is not None
    state.observe_batch(observation(0.020, job_latency_s))
    assert state.window_s == pytest.approx(before * factor)


@pytest.mark.parametrize(("job_latency_s", "bound"), [(10.0, 0.004), (0.0001, 0.040)])
def test_the_window_is_clamped(job_latency_s: float, bound: float) -> None:
    tuning = Tuning(batch_window_min_ms=4, batch_window_max_ms=40, latency_target_ms=100)
    state = SchedulerState.create(tuning)
    for _ in range(50):
        state.observe_batch(observation(0.010, job_latency_s))
    assert state.window_s == pytest.approx(bound)


def test_the_window_is_zero_when_idle_and_the_queue_is_short() -> None:
    state = SchedulerState.create(Tuning(batch_window_min_ms=10, batch_window_max_ms=50))
    state.observe_batch(observation(0.020, 0.02, ended_s=100.0))
    assert not state.profile(100.001).idle  # just finished a batch: busy
    assert state.profile(101.0).idle  # nothing for a second
    decision = decide([item("lone", arrival_s=101.0)], state.profile(101.0), 101.0)
    assert decision.trigger == "idle"


def test_target_cost_is_smoothed_seventy_thirty() -> None:
    state = SchedulerState.create(Tuning(batch_max_cost=10_000))
    state.batch_started()
    state.observe_batch(observation(0.01, 0.01))
    for cost in (100, 100):
        state.observe_arrival(cost)
    state.batch_started()  # demand 200, first measure
    assert state.target_cost == pytest.approx(200)
    state.observe_arrival(1000)
    state.batch_started()
    assert state.target_cost == pytest.approx(0.7 * 200 + 0.3 * 1000)
    state.batch_started()  # nothing arrived
    assert state.target_cost == pytest.approx(0.7 * 440 + 0.3 * 1)


def test_target_cost_converges_to_the_load_fixed_point() -> None:
    # lambda = 1000 cost/s, latency = 10 ms + 0.5 ms/cost: B = 10 / (1 - 0.5) = 20.
    state = SchedulerState.create(Tuning(batch_max_cost=10_000))
    target = 0.0
    for _ in range(200):
        state.batch_started()
        batch_s = 0.010 + 0.0005 * max(target, 1)
        state.observe_batch(observation(batch_s, batch_s))
        state.observe_arrival(round(1000 * batch_s))
        target = state.target_cost if math.isfinite(state.target_cost) else 1
    assert target == pytest.approx(20, abs=1.5)


def test_an_out_of_memory_lowers_the_ceiling_below_the_failed_batch() -> None:
    state = SchedulerState.create(
        Tuning(memory_budget_bytes=1000.0, memory_threshold=0.8),
        memory_prior=LinearFit(100.0, 1.0),
    )
    assert state.memory_ceiling == pytest.approx(800)
    assert state.profile(0.0).max_work == pytest.approx(700)
    state.observe_oom(500)  # predicted 600 bytes, yet out of memory
    assert state.memory_ceiling == pytest.approx(540)
    assert state.profile(0.0).max_work == pytest.approx(440)
    state.observe_oom(800)  # a larger failure never raises the ceiling
    assert state.memory_ceiling == pytest.approx(540)


def test_measured_peaks_replace_the_declared_estimate() -> None:
    state = SchedulerState.create(Tuning(), memory_prior=LinearFit(0.0, 100.0))
    for work in (10, 20, 40, 80) * 10:
        state.observe_batch(
            BatchObservation(
                size=1, cost=work, work=work, latency_s=0.01, ended_s=0.0,
                peak_memory_bytes=1000.0 + 10.0 * work,
            )
        )  # fmt: skip
    line = state.memory.fit()
    assert line(50) == pytest.approx(1500.0, rel=0.05)


def test_tuning_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="window"):
        Tuning(batch_window_min_ms=500, batch_window_max_ms=100)
    with pytest.raises(ValueError, match="memory_threshold"):
        Tuning(memory_threshold=0.0)
    with pytest.raises(ValueError, match="bulk_share"):
        Tuning(bulk_share=1.0)


# --- baselines ---------------------------------------------------------------------


def test_fixed_batching_is_first_come_first_served() -> None:
    pending = [item("u", "urgent", arrival_s=1.004)] + [
        item(f"n{i}", arrival_s=1.0 + i * 0.001) for i in range(3)
    ]
    assert decide_fixed(pending, 32, 0.005, 1.003).trigger is None  # not full, waited 3 ms
    decision = decide_fixed(pending, 32, 0.005, 3.0)
    assert keys(decision.run) == ["n0", "n1", "n2", "u"]
    full = decide_fixed([item(str(i), arrival_s=i) for i in range(40)], 32, 0.005, 0.0)
    assert len(full.run) == 32 and full.trigger == "size"


def test_no_batching_runs_the_oldest_alone() -> None:
    decision = decide_single([item("b", arrival_s=2.0), item("a", arrival_s=1.0)], 5.0)
    assert keys(decision.run) == ["a"]
    assert decide_single([], 0.0).run == ()


def test_profile_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_batch_cost"):
        Profile(max_batch_size=4, window_s=0.0, max_batch_cost=0)
    with pytest.raises(ValueError, match="bulk_slots"):
        Profile(max_batch_size=4, window_s=0.0, bulk_slots=-1)
    assert Profile(max_batch_size=4, window_s=0.0).max_work == INF


@pytest.mark.parametrize("ride", [math.inf, 1.25])
@pytest.mark.parametrize("padded", [False, True])
def test_bulk_never_starves_whatever_limit_closes_the_batches(padded: bool, ride: float) -> None:
    # Normal work always fills the cost cap; one old, long bulk job waits.
    state = SchedulerState.create(
        Tuning(
            batch_max_size=32,
            batch_max_cost=100,
            padded=padded,
            bulk_share=0.25,
            bulk_ride_factor=ride,
        ),
        latency_prior=LinearFit(0.001, 1e-5),
    )
    bulk = item("bulk", "bulk", cost=50, arrival_s=0.0)
    pending = [bulk]
    ran_bulk_at = None
    now = 1.0
    for turn in range(12):
        pending += [item(f"n{turn}-{i}", cost=10, arrival_s=now - 0.5) for i in range(10)]
        decision = decide(pending, state.profile(now), now)
        assert decision.run, decision
        ran = {i.key for i in decision.run}
        if "bulk" in ran:
            ran_bulk_at = turn
            break
        pending = [i for i in pending if i.key not in ran]
        state.observe_batch(
            BatchObservation(
                size=len(decision.run), cost=100, work=100, latency_s=0.002, ended_s=now,
                lanes=[i.lane for i in decision.run],
            )
        )  # fmt: skip
        now += 0.002
    assert ran_bulk_at is not None and ran_bulk_at <= 4  # a turn every 1 / 0.25 batches


def test_no_bulk_turn_while_an_urgent_job_waits() -> None:
    pending = [item("b", "bulk", arrival_s=0.0), item("u", "urgent", arrival_s=1.0)]
    decision = decide(pending, profile(window_s=0.0, bulk_turn=True, max_batch_size=1), 2.0)
    assert keys(decision.run) == ["u"]


def test_a_split_batch_teaches_nothing() -> None:
    state = SchedulerState.create(Tuning(), latency_prior=LinearFit(0.01, 0.0))
    before = state.latency.fit()
    state.observe_batch(
        BatchObservation(size=8, cost=80, work=80, latency_s=5.0, ended_s=1.0, split=True)
    )
    assert state.latency.fit() == before
    assert state.window_s is None


def test_a_lowered_memory_ceiling_recovers_after_clean_batches() -> None:
    state = SchedulerState.create(
        Tuning(memory_budget_bytes=1000.0, memory_threshold=0.8),
        memory_prior=LinearFit(0.0, 1.0),
    )
    state.observe_oom(500)  # ceiling 450
    low = state.memory_ceiling
    for _ in range(99):
        state.observe_batch(observation(0.01, 0.01))
    assert state.memory_ceiling == low  # not yet
    for _ in range(3500):  # 1.02 per 100 batches: 450 -> 800 takes 30 steps
        state.observe_batch(observation(0.01, 0.01))
    assert low < state.memory_ceiling == pytest.approx(800)  # back to the threshold, no higher


def test_a_wait_shorter_than_a_nanosecond_is_no_wait() -> None:
    decision = decide([item("a", arrival_s=0.0)], profile(window_s=0.3), 0.3 - 4e-15)
    assert decision.trigger == "time"


# --- bulk riders ---------------------------------------------------------------

# 20 ms + 0.5 ms per unit of cost, as the sim model is configured in bench/backfill.py.
SIM = LinearFit(0.020, 0.0005)


@pytest.mark.parametrize(
    ("pending", "prof", "ran", "trigger"),
    [
        # Without the rule, bulk fills the batch up to its size.
        (
            [item("n", cost=10)] + [item(f"b{i}", "bulk", cost=10) for i in range(7)],
            profile(latency=SIM, target_cost=10),
            ["n", *(f"b{i}" for i in range(7))],
            "size",
        ),
        # 1.25 x (20 + 5 ms) = 31.25 ms: one bulk rider fits (30 ms), two do not (35 ms).
        (
            [item("n", cost=10)] + [item(f"b{i}", "bulk", cost=10) for i in range(7)],
            profile(latency=SIM, target_cost=10, bulk_ride_factor=1.25),
            ["n", "b0"],
            "latency",
        ),
        # The reserved slots ride whatever the factor (a backfill always moves).
        (
            [item("n", cost=10)] + [item(f"b{i}", "bulk", cost=10) for i in range(7)],
            profile(latency=SIM, target_cost=10, bulk_ride_factor=1.0, bulk_slots=1),
            ["n", "b0"],
            "latency",
        ),
        # A batch of bulk alone is not limited by the rule.
        (
            [item(f"b{i}", "bulk", cost=10) for i in range(8)],
            profile(latency=SIM, bulk_ride_factor=1.0),
            [f"b{i}" for i in range(8)],
            "size",
        ),
        # Nor is a batch of interactive items alone.
        (
            [item(f"n{i}", cost=10) for i in range(8)],
            profile(latency=SIM, bulk_ride_factor=1.0),
            [f"n{i}" for i in range(8)],
            "size",
        ),
        # Cut by the rule with no other limit: it is closed, so it runs now.
        (
            [item("n", cost=10, arrival_s=0.09)]
            + [item(f"b{i}", "bulk", cost=10) for i in range(3)],
            profile(latency=SIM, bulk_ride_factor=1.25),
            ["n", "b0"],
            "latency",
        ),
    ],
)
def test_bulk_rides_with_interactive_items_only_up_to_the_factor(
    pending: list[PendingItem], prof: Profile, ran: list[str], trigger: str
) -> None:
    decision = decide(pending, prof, now=0.1)
    assert keys(decision.run) == ran
    assert decision.trigger == trigger


def test_bulk_ride_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="bulk_ride_factor"):
        profile(bulk_ride_factor=0.9)
