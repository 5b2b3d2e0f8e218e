# ruff: noqa: RUF001
"""What durable generation's promises cost and what they give, on the engine itself.

One llama-shaped folder (``ferry.lm_build``, random weights, no end-of-sequence
token, so every request generates exactly its ``max_tokens``) is loaded here
as the worker loads it (``backends.generation.CausalLMRuntime``) and stepped
by the worker's engine (``workers.gpu.engine.GenerationEngine``) on the real
clock, each request added the first step after it arrives. Four figures, each
measured side by side in one run, repeated, with the spread:

* **preemption**: the KV pool full of bulk generations, urgent requests
  arrive one by one. Urgent time to first token with Ferry's scheduler and
  with the same scheduler forbidden to preempt (``NoPreemption``: an urgent
  request then waits for room, as in a server whose priorities only order
  the queue); what it costs the bulk jobs it preempted (their end, against
  the same job's in the run without preemption); whether each preempted job
  still produced the tokens it produces unpreempted (greedy) and never
  streamed a token twice (restarted from zero).
* **fairness**: a *light* key sends short generations at a steady Poisson
  rate, alone (*idle*) and then beside a *flooding* key that sends long
  generations at ``--flood-factor`` times its rate (equal weights). The
  light key's TTFT p50/p99 both ways, in ms and in steps.
* **split**: two keys both backlogged with long generations, weights 3 and 1:
  the heavier key's share of the KV blocks held and of the step tokens, over
  time, against its weight's share (0.75).
* **checkpoint**: the stream is the checkpoint: the worker writes each
  step's tokens to their jobs' events streams in Redis
  (``workers.gpu.checkpoint.TokenWriter``: one script call for all it holds).
  The same workload without those writes, and with them (a Redis of its own)
  as the worker makes them by default (every step's in that step, on the
  writer's thread), in the loop (``FERRY_PIPELINE=false``) and every 50 ms
  (``FERRY_CHECKPOINT_EVERY_MS``): tokens/s and the cost. Each arm runs a few
  seconds, so a round runs them ``checkpoint_trials`` times, the four in a
  rotating order, and a round's cost is the median of its trials' costs (each
  against the run without writes of the same trial): a cost of a few per cent
  is smaller than one run's noise on a shared host.

What a crash costs a generation (tokens lost, the resumed job's extra
latency) needs real processes killed: ``bench.generation_resume`` and the
fault suite (``make faults``) measure it.

    python -m bench.generation_promises [--repeats 3] [--smoke]
                                        [--out bench/results/generation_promises.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import results
from bench.generation_stack import InProcess, Model, build, corpus_tokens, model_settings
from bench.generation_workload import (
    OUTPUTS,
    PROMPTS,
    Lengths,
    add_shared_options,
    draw_workload,
    ratio_spread,
)
from bench.quantiles import median_range, quantile
from bench.report import (
    Figure,
    Fmt,
    Results,
    Spread,
    counted,
    decimal,
    measured_on,
    percent,
    table,
    times,
)
from scheduler.generation import (
    FinishReason,
    GenerationLimits,
    GenerationRequest,
    GenerationScheduler,
    Lane,
)
from workers.gpu.checkpoint import TokenWriter

if TYPE_CHECKING:
    from workers.gpu.engine import StepEvents


class NoPreemption(GenerationScheduler):
    """Ferry's scheduler with urgent preemption taken out: the comparison arm only. An
    urgent request that does not fit waits, at the head of the queue, for room."""

    def _evict_for(self, sequence: Any, draft: Any) -> bool:
        return False


@dataclass(frozen=True)
class Job:
    """One request of a load: its prompt and length, when it arrives, whose it is."""

    id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    lane: Lane = Lane.NORMAL
    tenant: str = ""
    weight: float = 1.0


@dataclass
class StepSeen:
    """One step as the load saw it: when it ran, the blocks and the step tokens each
    tenant held in it."""

    start_s: float
    end_s: float
    blocks: dict[str, int]
    tokens: dict[str, int]


@dataclass
class Trace:
    """What one run of a load recorded, in seconds since it started."""

    arrived_step: dict[str, int] = field(default_factory=dict)
    first_s: dict[str, float] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)
    end_s: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: dict[str, int] = field(default_factory=dict)
    steps: list[StepSeen] = field(default_factory=list)

    def ttft_ms(self, jobs: Sequence[Job]) -> list[float]:
        return [1000.0 * (self.first_s[j.id] - j.arrival_s) for j in jobs if j.id in self.first_s]

    def ttft_steps(self, jobs: Sequence[Job]) -> list[int]:
        """For each job, the steps from its arrival to its first token, that one's included
        (1: the first step after it arrived)."""
        return [
            self.first_step[j.id] - self.arrived_step[j.id] + 1
            for j in jobs
            if j.id in self.first_step
        ]

    def step_ms(self) -> float:
        """The mean duration of a step that computed something."""
        if not self.steps:
            return float("nan")
        return 1000.0 * statistics.fmean(s.end_s - s.start_s for s in self.steps)


AfterStep = Callable[["StepEvents"], None]


def drive(
    runner: Any,
    limits: GenerationLimits,
    jobs: Sequence[Job],
    scheduler_type: type[GenerationScheduler] = GenerationScheduler,
    after_step: AfterStep | None = None,
    until: Callable[[Trace, float], bool] | None = None,
) -> Trace:
    """The load through a fresh scheduler on ``runner``, stepped on the real clock, until
    every job ended (or ``until(trace, now)``); what the runtime still holds then is
    dropped."""
    # Here, not at the top: rendering this benchmark's tables needs no torch.
    from backends.generation.runtime import GenerationInput
    from workers.gpu.engine import GenerationEngine

    scheduler = scheduler_type(limits)
    engine = GenerationEngine(scheduler, runner)
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    tenant_of = {j.id: j.tenant for j in jobs}
    trace = Trace(tokens={j.id: [] for j in jobs})
    ended, next_up = 0, 0
    start = time.perf_counter()
    try:
        while ended < len(pending):
            now = time.perf_counter() - start
            if until is not None and until(trace, now):
                break
            while next_up < len(pending) and pending[next_up].arrival_s <= now:
                j = pending[next_up]
                request = GenerationRequest(
                    j.id,
                    len(j.prompt_ids),
                    j.max_tokens,
                    j.lane,
                    j.tenant,
                    arrival=j.arrival_s,
                    weight=j.weight,
                )
                engine.add(request, GenerationInput(j.prompt_ids, j.max_tokens))
                trace.arrived_step[j.id] = len(trace.steps)
                next_up += 1
            if scheduler.running_count == 0 and scheduler.waiting_count == 0:
                time.sleep(max(0.0, pending[next_up].arrival_s - now))
                continue
            events = engine.step(now)
            if after_step is not None:
                after_step(events)
            done = time.perf_counter() - start
            plan = events.plan
            for id in plan.preempted:
                trace.preempted[id] = trace.preempted.get(id, 0) + 1
            for id, emitted in events.emitted.items():
                trace.tokens[id].append(emitted.token)
                if id not in trace.first_s:
                    trace.first_s[id], trace.first_step[id] = done, len(trace.steps)
            for id, completion in events.ended.items():
                if completion.finish_reason != FinishReason.LENGTH:
                    raise RuntimeError(f"{id} ended {completion.finish_reason}, not at max_tokens")
                trace.end_s[id] = done
                ended += 1
            if not plan.empty:
                blocks: dict[str, int] = {}
                for id, held in scheduler.owned_blocks().items():
                    blocks[tenant_of[id]] = blocks.get(tenant_of[id], 0) + len(held)
                tokens: dict[str, int] = {}
                for chunk in plan.prefill:
                    tokens[tenant_of[chunk.id]] = tokens.get(tenant_of[chunk.id], 0) + chunk.length
                for id in plan.decode:
                    tokens[tenant_of[id]] = tokens.get(tenant_of[id], 0) + 1
                trace.steps.append(StepSeen(now, done, blocks, tokens))
    finally:
        runner.clear()
    return trace


# --- the loads -------------------------------------------------------------------------


def windows(corpus: Sequence[int], rng: random.Random, lengths: Lengths) -> tuple[int, ...]:
    length = lengths.draw(rng)
    start = rng.randrange(len(corpus) - length)
    return tuple(corpus[start : start + length])


@dataclass(frozen=True)
class Shape:
    """The sizes of the loads (full run or smoke)."""

    bulk: int = 24  # bulk generations filling the preemption load's running batch 3 times
    bulk_running: int = 8  # its running batch (and a KV pool for that many bulk ones)
    bulk_tokens: int = 160
    urgent: int = 8
    urgent_every_s: float = 0.6
    light_rate: float = 2.0  # the light key's requests a second
    light_s: float = 20.0  # how long it sends them
    light_tokens: int = 16
    flood_factor: float = 50.0
    flood_tokens: int = 128
    split_jobs: int = 160  # per key, all at once (the run ends when a key has none waiting)
    split_s: float = 12.0
    checkpoint_requests: int = 32
    checkpoint_trials: int = 5  # the four checkpoint arms, each this many times a round


SMOKE = Shape(
    bulk=8,
    bulk_running=4,
    bulk_tokens=24,
    urgent=2,
    urgent_every_s=0.2,
    light_rate=4.0,
    light_s=1.5,
    light_tokens=4,
    flood_factor=5.0,
    flood_tokens=16,
    split_jobs=8,
    split_s=1.0,
    checkpoint_requests=6,
    checkpoint_trials=1,
)

SHORT = Lengths(median=24.0, sigma=0.5, low=8, high=64)
LONG = Lengths(median=96.0, sigma=0.5, low=32, high=256)


def preemption_load(corpus: Sequence[int], shape: Shape, seed: int) -> list[Job]:
    """One key's bulk generations, all at once, then its urgent requests one by one (one key:
    the tenants' shares play no part, only the lanes)."""
    rng = random.Random(seed)
    bulk = [
        Job(f"bulk{i}", windows(corpus, rng, LONG), shape.bulk_tokens, 0.0, Lane.BULK)
        for i in range(shape.bulk)
    ]
    urgent = [
        Job(
            f"urgent{i}",
            windows(corpus, rng, SHORT),
            8,
            0.5 + i * shape.urgent_every_s,
            Lane.URGENT,
        )
        for i in range(shape.urgent)
    ]
    return bulk + urgent


def poisson(rng: random.Random, rate: float, seconds: float) -> list[float]:
    times, now = [], rng.expovariate(rate)
    while now < seconds:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def fairness_load(corpus: Sequence[int], shape: Shape, seed: int, flood: bool) -> list[Job]:
    """The light key's requests; with ``flood``, the flooding key's beside them (the light
    key's are the same both ways)."""
    rng = random.Random(seed)
    light = [
        Job(f"light{i}", windows(corpus, rng, SHORT), shape.light_tokens, t, tenant="light")
        for i, t in enumerate(poisson(rng, shape.light_rate, shape.light_s))
    ]
    if not flood:
        return light
    rate = shape.flood_factor * shape.light_rate
    return light + [
        Job(f"flood{i}", windows(corpus, rng, LONG), shape.flood_tokens, t, tenant="flood")
        for i, t in enumerate(poisson(rng, rate, shape.light_s))
    ]


def split_load(corpus: Sequence[int], shape: Shape, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job(
            f"{tenant}{i}",
            windows(corpus, rng, LONG),
            shape.flood_tokens,
            0.0,
            tenant=tenant,
            weight=weight,
        )
        for i in range(shape.split_jobs)
        for tenant, weight in (("heavy", 3.0), ("light", 1.0))
    ]


# --- the figures -----------------------------------------------------------------------


@dataclass
class Quantiles:
    p50: float
    p99: float
    max: float


@dataclass
class PreemptionRound:
    urgent_ttft_ms: dict[str, Quantiles]  # preemption, no_preemption
    urgent_ttft_steps: dict[str, Quantiles]
    bulk_jobs: int
    preempted_jobs: int
    preemptions: int
    preempted_delay_ms: Quantiles
    preempted_outputs_equal: int
    restarted_from_zero: int
    bulk_span_s: dict[str, float]


@dataclass
class FairnessRound:
    light_requests: int
    light_ttft_ms: dict[str, Quantiles]  # idle, flood
    light_ttft_steps: dict[str, Quantiles]
    flood_requests: int
    flood_kv_share: float
    step_ms: dict[str, float]


@dataclass
class SplitRound:
    steps: int
    heavy_kv_share: float
    heavy_token_share: float
    weight_share: float


@dataclass
class CheckpointRound:
    tokens_per_s: dict[str, float]  # without, with, in_loop, every_50_ms: the trials' median
    cost: dict[str, float]  # with, in_loop, every_50_ms: the trials' median of 1 - arm/without
    trials: list[dict[str, float]]  # each trial's tokens/s by arm
    appended: int


@dataclass
class Round:
    preemption: PreemptionRound
    fairness: FairnessRound
    split: SplitRound
    checkpoint: CheckpointRound


@dataclass
class Report:
    """bench/results/generation_promises.json besides its head (bench.report.typed reads it)."""

    rounds: list[Round]
    urgent_ttft_p99_ms: dict[str, Spread]
    urgent_ttft_gain: Spread
    preempted_delay_p50_ms: Spread
    preempted_jobs: int
    preempted_outputs_equal: int
    restarted_from_zero: int
    light_ttft_p99_ms: dict[str, Spread]
    light_ttft_p99_ratio: Spread
    light_ttft_p99_steps: dict[str, Spread]
    flood_kv_share: Spread
    step_ms_ratio: Spread
    heavy_kv_share: Spread
    heavy_token_share: Spread
    checkpoint_cost: Spread
    checkpoint_cost_in_loop: Spread
    checkpoint_cost_every_50_ms: Spread
    seconds: float = 0.0  # written with the last round's file


RESULT = Report


def p(values: Sequence[float], q: float) -> float:
    return round(quantile(values, q), 2)


def preemption_round(ferry: Trace, without: Trace, jobs: Sequence[Job]) -> dict[str, Any]:
    """One repeat of the preemption load, both ways."""
    urgent = [j for j in jobs if j.lane is Lane.URGENT]
    bulk = [j for j in jobs if j.lane is Lane.BULK]
    preempted = [j for j in bulk if ferry.preempted.get(j.id)]
    delays = [1000.0 * (ferry.end_s[j.id] - without.end_s[j.id]) for j in preempted]
    return {
        **_ttfts("urgent", urgent, preemption=ferry, no_preemption=without),
        "bulk_jobs": len(bulk),
        "preempted_jobs": len(preempted),
        "preemptions": sum(ferry.preempted.values()),
        "preempted_delay_ms": _quantiles(delays),
        "preempted_outputs_equal": sum(
            ferry.tokens[j.id] == without.tokens[j.id] for j in preempted
        ),
        "restarted_from_zero": sum(len(ferry.tokens[j.id]) != j.max_tokens for j in preempted),
        "bulk_span_s": {
            "preemption": round(max(ferry.end_s.values()), 3),
            "no_preemption": round(max(without.end_s.values()), 3),
        },
    }


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    return {"p50": p(values, 0.5), "p99": p(values, 0.99), "max": p(values, 1.0)}


def _ttfts(name: str, jobs: Sequence[Job], **traces: Trace) -> dict[str, Any]:
    """``jobs``' times to first token in each trace, by the trace's name: in ms
    (``{name}_ttft_ms``) and in steps (``{name}_ttft_steps``)."""
    return {
        f"{name}_ttft_ms": {run: _quantiles(t.ttft_ms(jobs)) for run, t in traces.items()},
        f"{name}_ttft_steps": {run: _quantiles(t.ttft_steps(jobs)) for run, t in traces.items()},
    }


def fairness_round(idle: Trace, flooded: Trace, jobs: Sequence[Job]) -> dict[str, Any]:
    light = [j for j in jobs if j.tenant == "light"]
    shares = weighted_share(flooded.steps, "flood", "blocks")
    return {
        "light_requests": len(light),
        **_ttfts("light", light, idle=idle, flood=flooded),
        "flood_requests": sum(1 for j in jobs if j.tenant == "flood"),
        "flood_kv_share": shares,
        "step_ms": {"idle": round(idle.step_ms(), 2), "flood": round(flooded.step_ms(), 2)},
    }


def weighted_share(steps: Sequence[StepSeen], tenant: str, what: str) -> float:
    """``tenant``'s share of what the steps' tenants held (``blocks``) or computed
    (``tokens``), each step weighed by its duration."""
    held = total = 0.0
    for step in steps:
        counts = step.blocks if what == "blocks" else step.tokens
        whole = sum(counts.values())
        if whole:
            seconds = step.end_s - step.start_s
            held += seconds * counts.get(tenant, 0) / whole
            total += seconds
    return round(held / total, 4) if total else float("nan")


def split_round(trace: Trace, jobs: Sequence[Job]) -> dict[str, Any]:
    """The heavy key's shares while both keys still had work waiting (the run stops at
    ``split_s``, or once a key has nothing waiting: :func:`_split_over`)."""
    steps = trace.steps[5:]  # the first admissions settle
    return {
        "steps": len(steps),
        "heavy_kv_share": weighted_share(steps, "heavy", "blocks"),
        "heavy_token_share": weighted_share(steps, "heavy", "tokens"),
        "weight_share": 0.75,
    }


class Checkpoint:
    """After each step, what a worker does with the step's tokens: each goes to a
    ``workers.gpu.checkpoint.TokenWriter`` (the worker's), which writes them when due
    (one script call for all it holds), a job's first token at once, and what is held
    before a job is recorded as ended."""

    def __init__(self, writer: TokenWriter) -> None:
        self.writer = writer
        self.index: dict[str, int] = {}
        self.appended = 0

    def __call__(self, events: StepEvents) -> None:
        from core.streams.events import JobEvent

        first = False
        for id, emitted in events.emitted.items():
            index = self.index.get(id, 0)
            first |= index == 0
            self.index[id] = index + 1
            event = JobEvent.token_event(index, emitted.token, emitted.text)
            self.writer.add(f"ferrybench:events:{id}", event)
        self.appended += len(events.emitted)
        self.writer.step(urgent=first)
        if events.ended:
            self.writer.write()

    def clear(self) -> None:
        self.writer.write()
        self.writer.wait()
        self.writer.client.flushdb()
        self.index.clear()


def checkpoint_round(trials: Sequence[dict[str, float]], appended: int) -> dict[str, Any]:
    """A round's checkpoint figures from its trials (each arm's tokens/s): each arm's
    tokens/s and its cost against the run without writes of the same trial, each the
    median over the trials."""
    arms = list(trials[0])
    return {
        "tokens_per_s": {way: statistics.median(t[way] for t in trials) for way in arms},
        "cost": {
            way: round(statistics.median(1.0 - t[way] / t["without"] for t in trials), 4)
            for way in arms
            if way != "without"
        },
        "trials": list(trials),
        "appended": appended,
    }


def tokens_per_s(trace: Trace) -> float:
    tokens = sum(len(t) for t in trace.tokens.values())
    return tokens / max(trace.end_s.values())


# --- the run -------------------------------------------------------------------------


def run(
    local: InProcess,
    model: Model,
    shape: Shape,
    repeats: int,
    seed: int,
    redis_url: str,
    out: Path,
    head: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    runner = local.runtime.runner
    loaded = local.runtime.limits
    corpus = corpus_tokens(local)
    # The preemption load: room for ``bulk_running`` bulk jobs, slots and blocks, and no
    # more: an urgent one fits only in a bulk one's place.
    bulk_blocks = loaded.blocks_for(LONG.high + shape.bulk_tokens)
    tight = GenerationLimits(
        kv_blocks=min(loaded.kv_blocks, shape.bulk_running * bulk_blocks),
        block_size=loaded.block_size,
        max_running=shape.bulk_running,
        step_tokens=loaded.step_tokens,
        prefill_chunk_tokens=loaded.prefill_chunk_tokens,
    )
    settings["preemption_kv_blocks"] = tight.kv_blocks
    import redis

    client = redis.Redis.from_url(redis_url)
    # The worker's default (every step's tokens in that step, on the writer's thread), the
    # same in the loop (FERRY_PIPELINE=false), and every 50 ms (FERRY_CHECKPOINT_EVERY_MS).
    hooks = {
        "with": Checkpoint(TokenWriter(client, pipelined=True)),
        "in_loop": Checkpoint(TokenWriter(client)),
        "every_50_ms": Checkpoint(TokenWriter(client, 10**6, 50.0, pipelined=True)),
    }
    report: dict[str, Any] = {"rounds": []}
    for number in range(repeats):
        print(f"repeat {number + 1} of {repeats}", flush=True)
        round_seed = seed + number
        jobs = preemption_load(corpus, shape, round_seed)
        # Alternating which way runs first: neither always runs on a warmer machine.
        ways = [(GenerationScheduler, "ferry"), (NoPreemption, "without")]
        traces = {name: drive(runner, tight, jobs, kind) for kind, name in _ordered(ways, number)}
        preemption = preemption_round(traces["ferry"], traces["without"], jobs)
        idle_jobs = fairness_load(corpus, shape, round_seed, flood=False)
        flood_jobs = fairness_load(corpus, shape, round_seed, flood=True)
        light_done = _all_ended([j.id for j in idle_jobs])
        idle = drive(runner, loaded, idle_jobs)
        flooded = drive(runner, loaded, flood_jobs, until=light_done)
        fairness = fairness_round(idle, flooded, flood_jobs)
        split_jobs = split_load(corpus, shape, round_seed)
        split = split_round(
            drive(runner, loaded, split_jobs, until=_split_over(split_jobs, shape.split_s)),
            split_jobs,
        )
        workload = [
            Job(r.id, r.prompt_ids, r.max_tokens, 0.0)
            for r in draw_workload(corpus, shape.checkpoint_requests, round_seed, PROMPTS, OUTPUTS)
        ]
        arms: list[tuple[str, Checkpoint | None]] = [("without", None), *hooks.items()]
        trials: list[dict[str, float]] = []
        for trial in range(shape.checkpoint_trials):
            # A rotating order: no arm always runs first (on a warmer or a quieter host).
            turn = (number * shape.checkpoint_trials + trial) % len(arms)
            rates: dict[str, float] = {}
            for way, hook in arms[turn:] + arms[:turn]:
                rates[way] = tokens_per_s(drive(runner, loaded, workload, after_step=hook))
                if hook is not None:
                    hook.clear()
            trials.append({k: round(v, 2) for k, v in rates.items()})
        report["rounds"].append(
            {
                "preemption": preemption,
                "fairness": fairness,
                "split": split,
                "checkpoint": checkpoint_round(trials, sum(c.appended for c in hooks.values())),
            }
        )
        report.update(figures(report["rounds"]))
        results.write(out, report, settings=settings, head=head)
    for checkpoint in hooks.values():
        checkpoint.writer.close()
    return report


def _ordered(ways: list[Any], number: int) -> list[Any]:
    return ways if number % 2 == 0 else list(reversed(ways))


def _split_over(jobs: Sequence[Job], seconds: float) -> Callable[[Trace, float], bool]:
    """The split's end: ``seconds`` in, or as soon as a key has nothing waiting (every job
    of it started): past that its share is no longer the scheduler's choice (on a fast
    host the heavier key once ran out of work within the run and its share fell)."""
    by_key: dict[str, list[str]] = {}
    for job in jobs:
        by_key.setdefault(job.tenant, []).append(job.id)

    def over(trace: Trace, now: float) -> bool:
        started = trace.first_s
        return now >= seconds or any(all(id in started for id in ids) for ids in by_key.values())

    return over


def _all_ended(ids: Sequence[str]) -> Callable[[Trace, float], bool]:
    def ended(trace: Trace, _now: float) -> bool:
        return all(id in trace.end_s for id in ids)

    return ended


def figures(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures over the repeats: each a median and a range."""
    pre = [r["preemption"] for r in rounds]
    fair = [r["fairness"] for r in rounds]
    split = [r["split"] for r in rounds]
    costs = [r["checkpoint"]["cost"] for r in rounds]
    return {
        "urgent_ttft_p99_ms": {
            "preemption": median_range([r["urgent_ttft_ms"]["preemption"]["p99"] for r in pre]),
            "no_preemption": median_range(
                [r["urgent_ttft_ms"]["no_preemption"]["p99"] for r in pre]
            ),
        },
        "urgent_ttft_gain": ratio_spread(
            [r["urgent_ttft_ms"]["no_preemption"]["p99"] for r in pre],
            [r["urgent_ttft_ms"]["preemption"]["p99"] for r in pre],
        ),
        "preempted_delay_p50_ms": median_range([r["preempted_delay_ms"]["p50"] for r in pre]),
        "preempted_jobs": sum(r["preempted_jobs"] for r in pre),
        "preempted_outputs_equal": sum(r["preempted_outputs_equal"] for r in pre),
        "restarted_from_zero": sum(r["restarted_from_zero"] for r in pre),
        "light_ttft_p99_ms": {
            "idle": median_range([r["light_ttft_ms"]["idle"]["p99"] for r in fair]),
            "flood": median_range([r["light_ttft_ms"]["flood"]["p99"] for r in fair]),
        },
        "light_ttft_p99_ratio": ratio_spread(
            [r["light_ttft_ms"]["flood"]["p99"] for r in fair],
            [r["light_ttft_ms"]["idle"]["p99"] for r in fair],
        ),
        "light_ttft_p99_steps": {
            "idle": median_range([r["light_ttft_steps"]["idle"]["p99"] for r in fair]),
            "flood": median_range([r["light_ttft_steps"]["flood"]["p99"] for r in fair]),
        },
        "flood_kv_share": median_range([r["flood_kv_share"] for r in fair]),
        "step_ms_ratio": ratio_spread(
            [r["step_ms"]["flood"] for r in fair], [r["step_ms"]["idle"] for r in fair]
        ),
        "heavy_kv_share": median_range([r["heavy_kv_share"] for r in split]),
        "heavy_token_share": median_range([r["heavy_token_share"] for r in split]),
        "checkpoint_cost": median_range([c["with"] for c in costs]),
        "checkpoint_cost_in_loop": median_range([c["in_loop"] for c in costs if "in_loop" in c]),
        "checkpoint_cost_every_50_ms": median_range(
            [c["every_50_ms"] for c in costs if "every_50_ms" in c]
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_options(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-mib", type=float, default=256.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/generation_promises.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    smoke = args.smoke or os.environ.get(results.SMOKE_ENV) == "1"
    shape = Shape()
    if smoke:
        args.repeats, shape = 1, SMOKE
        args.layers, args.hidden, args.heads, args.kv_mib = 2, 128, 4, 16.0
    head = results.provenance("generation_promises", argv)
    head["smoke"] = smoke
    started = time.monotonic()
    from harness.services import started_redis

    with tempfile.TemporaryDirectory(prefix="ferry-bench-promises-") as tmp:
        model, context = build(args, Path(tmp))
        local = InProcess(model, args.threads, args.device, args.precision)
        settings = {
            "smoke": smoke,
            "device": args.device,
            "precision": args.precision,
            "threads": args.threads,
            **model_settings(args, context, local),
            "shape": asdict(shape),
            "repeats": args.repeats,
            "seed": args.seed,
            "eos": "none: every request generates exactly its max_tokens",
        }
        with started_redis(Path(tmp) / "redis") as url:
            report = run(
                local, model, shape, args.repeats, args.seed, url, args.out, head, settings
            )
    report["seconds"] = round(time.monotonic() - started, 1)
    results.write(args.out, report, settings=settings, head=head)
    print(
        f"urgent TTFT p99 {report['urgent_ttft_gain']['median']:.1f}x lower with preemption; "
        f"light TTFT p99 under a {shape.flood_factor:.0f}x flood "
        f"{report['light_ttft_p99_ratio']['median']:.2f}x idle; heavy KV share "
        f"{report['heavy_kv_share']['median']:.3f} (weight 0.75); checkpoint cost "
        f"{100 * report['checkpoint_cost']['median']:.1f} %; wrote {args.out} "
        f"in {report['seconds']:.0f} s"
    )
    return 0


# --- its tables (python -m bench.render) --------------------------------------------------


def render_generation_promises(results: Results) -> list[str]:
    # A figure of nothing measured (as a smoke run on a busy machine may leave) is NaN.
    doc, report = results["generation_promises"], results.typed("generation_promises", Report)
    s, m, shape = doc["settings"], doc["settings"]["model"], doc["settings"]["shape"]
    ms = decimal(0, " ms")

    def fig(name: str, fmt: Fmt, *keys: str, bold: bool = False) -> str:
        found: Any = getattr(report, name)
        for key in keys:
            found = found[key]
        return Figure.summary(found).text(fmt, bold)

    def steps(way: str) -> str:
        per_round = [r.preemption.urgent_ttft_steps[way].p99 for r in report.rounds]
        return Figure.of(per_round if len(set(per_round)) > 1 else per_round[:1]).text(decimal())

    gain = Figure.summary(report.urgent_ttft_gain)
    ratio = Figure.summary(report.light_ttft_p99_ratio)
    share = Figure.summary(report.heavy_kv_share)
    cost = Figure.summary(report.checkpoint_cost)
    spaced = Figure.summary(report.checkpoint_cost_every_50_ms)
    preempted = report.preempted_jobs
    rows = [
        [
            f"urgent TTFT p99, the running batch full of bulk generations "
            f"({shape['bulk_running']} of {shape['bulk']}, {shape['bulk_tokens']} tokens each)",
            f"{fig('urgent_ttft_p99_ms', ms, 'preemption', bold=True)} with preemption, "
            f"{fig('urgent_ttft_p99_ms', ms, 'no_preemption')} without: "
            f"{gain.text(times(1))} sooner (in steps: {steps('preemption')} and "
            f"{steps('no_preemption')})",
            "within a few steps",
        ],
        [
            "the bulk jobs it preempted",
            f"{preempted} preempted in all, each ended {fig('preempted_delay_p50_ms', ms)} "
            f"later at the median; {report.preempted_outputs_equal} of {preempted} with the "
            f"tokens they make unpreempted, {report.restarted_from_zero} restarted from zero"
            if preempted
            else "none was preempted",
            "same tokens, 0 restarted",
        ],
        [
            f"a light key's TTFT p99 beside a flood at {shape['flood_factor']:g}× its rate "
            f"({shape['flood_tokens']}-token generations)",
            f"{fig('light_ttft_p99_ms', ms, 'idle')} idle, "
            f"{fig('light_ttft_p99_ms', ms, 'flood')} flooded: "
            f"{ratio.text(times(2), bold=True)} (in steps: "
            f"{fig('light_ttft_p99_steps', decimal(), 'idle')} and "
            f"{fig('light_ttft_p99_steps', decimal(), 'flood')}; a flooded step takes "
            f"{fig('step_ms_ratio', times(1))} an idle one)",
            f"≤ 1.5× ({'met' if ratio.meets(1.5, False) else 'not met'})",
        ],
        [
            "the heavier key's share of the KV blocks held, weights 3 and 1, both backlogged",
            f"{share.text(percent(1), bold=True)} (of the step tokens: "
            f"{fig('heavy_token_share', percent(1))})",
            f"75 % ± 10 % ({'met' if share.low >= 0.675 and share.high <= 0.825 else 'not met'})",
        ],
        [
            f"the checkpoint's writes (the tokens to their events streams), in tokens/s "
            f"(a round's figure: the median of its {shape['checkpoint_trials']} trials)",
            f"{cost.text(percent(1), bold=True)} fewer by default (every step's, on the "
            f"writer's thread), {fig('checkpoint_cost_in_loop', percent(1))} in the loop, "
            f"{spaced.text(percent(1), bold=True)} every 50 ms",
            f"≤ 5 % (by default: {'met' if cost.meets(0.05, False) else 'not met'}; "
            f"every 50 ms: {'met' if spaced.meets(0.05, False) else 'not met'})",
        ],
    ]
    return [
        f"{measured_on(doc)}; median of "
        f"{counted(len(report.rounds), 'repeat', 'repeats')} (min–max). A {m['arch']}-shaped "
        f"model of {m['layers']} layers, hidden {m['hidden']} (random weights), "
        f"{s['precision']} on `{s['device']}`, stepped by the worker's engine in one process; "
        f"max_running {s['limits']['max_running']}, step_tokens {s['limits']['step_tokens']}, "
        f"prefill_chunk_tokens {s['limits']['prefill_chunk_tokens']}.",
        "",
        *table(["promise", "measured", "target"], "lll", rows),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
