"""The generation scheduler under a seeded random load, its invariants checked at every step.

A fake paged-KV runtime executes each plan the way a real one must (free,
then append blocks, then compute) and checks the plan against what it holds:
chunks continue where the KV ends, decodes follow a sampled token, no block
is held past the pool, and a block is shared only where it holds the
sharers' common prompt prefix (prefix caching: the runtime remembers what
each block's KV is of) and is never written while shared. Hundreds of
requests with skewed prompt and output lengths, half of them beginning with
one of a few system prompts, random cancels and urgent arrivals; no clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from scheduler.generation import (
    FinishReason,
    GenerationLimits,
    GenerationRequest,
    GenerationScheduler,
    StepOutput,
    StepPlan,
)
from scheduler.generation_state import prefix_hashes
from scheduler.policy import LinearFit
from scheduler.vocabulary import Lane

LANES = (Lane.URGENT, Lane.VIP, Lane.NORMAL, Lane.BULK)
LANE_WEIGHTS = (0.05, 0.15, 0.5, 0.3)
ARRIVALS_PER_S = 1500.0  # more than the limits below serve: a queue builds


@dataclass
class Job:
    request: GenerationRequest
    target: int  # tokens it generates before its stop token (max_tokens: it runs to length)
    generated: int = 0
    computed: int = 0  # positions whose KV the runtime holds
    table: list[int] = field(default_factory=list)
    fresh: bool = False  # given its table this step: its first chunk may start past 0

    @property
    def known(self) -> int:
        return self.request.prompt_tokens + self.generated


class Runtime:
    """Executes plans on a pretend paged KV cache, asserting each is executable."""

    def __init__(self, limits: GenerationLimits, rng: random.Random) -> None:
        self.limits = limits
        self.rng = rng
        self.jobs: dict[str, Job] = {}
        self.owner: dict[int, set[str]] = {}
        # What each block's KV is of: a prompt prefix block's hash, else its writer's.
        self.content: dict[int, object] = {}
        self.unreported: set[str] = set()  # reached max_tokens, length not reported

    def free(self, id: str) -> None:
        job = self.jobs[id]
        for block in job.table:
            holders = self.owner[block]
            holders.remove(id)
            if not holders:
                del self.owner[block]
        job.table.clear()
        job.computed = 0

    def apply_blocks(self, plan: StepPlan) -> None:
        for id in (*plan.released, *plan.preempted):
            self.free(id)
        for id in plan.released:
            self.unreported.discard(id)
        for id, blocks in plan.blocks.items():
            job = self.jobs[id]
            assert not job.table, f"{id} is given a table while it holds one"
            cached = plan.cached.get(id, 0) // self.limits.block_size
            for index, block in enumerate(blocks):
                assert 0 <= block < self.limits.kv_blocks
                if index < cached:  # shared: it must hold this prompt's prefix already
                    assert self.content.get(block) == job.request.prefix[index], (id, index)
                else:
                    assert block not in self.owner, f"block {block} held by {self.owner[block]}"
                self.owner.setdefault(block, set()).add(id)
            job.table.extend(blocks)
            job.computed = cached * self.limits.block_size
            job.fresh = True
        assert len(self.owner) <= self.limits.kv_blocks

    def write(self, job: Job, start: int, end: int) -> None:
        """Compute the KV of positions ``[start, end)`` into the job's own blocks."""
        size = self.limits.block_size
        prefix = job.request.prefix
        for index in range(start // size, (end - 1) // size + 1):
            block = job.table[index]
            assert self.owner[block] == {job.request.id}, f"writes block {block}, shared"
            full = (index + 1) * size <= end
            self.content[block] = prefix[index] if full and index < len(prefix) else job

    def compute(self, plan: StepPlan) -> StepOutput:
        size = self.limits.block_size
        for chunk in plan.prefill:
            job = self.jobs[chunk.id]
            assert chunk.length >= 1 and chunk.start == job.computed, chunk
            assert chunk.end <= job.known and chunk.last == (chunk.end == job.known), chunk
            assert chunk.end <= len(job.table) * size, f"{chunk} past its blocks"
            self.write(job, chunk.start, chunk.end)
            job.computed = chunk.end
            job.fresh = False
        for id in plan.decode:
            job = self.jobs[id]
            assert job.computed == job.known - 1, f"{id} decodes without a sampled token"
            assert job.known <= len(job.table) * size, f"{id} decodes past its blocks"
            self.write(job, job.computed, job.computed + 1)
            job.computed += 1
        sampled: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        for id in plan.sampling:
            job = self.jobs[id]
            assert job.generated < job.request.max_tokens, f"{id} samples past max_tokens"
            job.generated += 1
            sampled[id] = job.generated
            if job.generated == job.target < job.request.max_tokens:
                finished[id] = FinishReason.STOP
            elif job.generated == job.request.max_tokens:
                if self.rng.random() < 0.3:  # a runtime that forgets: the scheduler guards
                    self.unreported.add(id)
                else:
                    finished[id] = FinishReason.LENGTH
        for id in finished:
            self.free(id)
        return StepOutput(sampled, finished, 0.002 + 2e-5 * plan.tokens)


# System prompts that half the requests begin with (the rest of each prompt its own).
SYSTEMS = [[1_000 * s + i for i in range(length)] for s, length in enumerate((3, 40, 130))]


def new_request(rng: random.Random, n: int, now: float, block_size: int = 16) -> GenerationRequest:
    lane = rng.choices(LANES, LANE_WEIGHTS)[0]
    prompt = max(1, min(900, int(4 * rng.paretovariate(1.1))))
    tokens = [10**6 + 10**3 * n + i for i in range(prompt)]
    if rng.random() < 0.5:
        system = rng.choice(SYSTEMS)
        tokens = (system + tokens)[:900]
        prompt = len(tokens)
    max_tokens = max(1, min(400, int(8 * rng.paretovariate(1.0))))
    deadline = None
    if lane is not Lane.URGENT and rng.random() < 0.2:
        deadline = now + rng.uniform(0.005, 0.3)
    return GenerationRequest(
        f"r{n}",
        prompt,
        max_tokens,
        lane,
        f"t{rng.randrange(4)}",
        deadline,
        arrival=now,
        prefix=prefix_hashes(tokens, block_size),
    )


def urgent_can_fit(
    limits: GenerationLimits, request: GenerationRequest, jobs: dict[str, Job], running: set[str]
) -> bool:
    """Whether preempting every running sequence of a lower lane that could be resumed
    would make room for it (with whole prompts only, one resumes only if its known
    tokens fit a step)."""
    whole = limits.prefill_chunk_tokens == 0
    kept = [
        jobs[id]
        for id in running
        if jobs[id].request.lane is Lane.URGENT or (whole and jobs[id].known > limits.step_tokens)
    ]
    held = sum(limits.blocks_for(job.request.total_tokens) for job in kept)
    chunk = limits.prefill_chunk_tokens or limits.step_tokens
    tokens = sum(
        1 if job.computed == job.known - 1 else min(chunk, job.known - job.computed) for job in kept
    )
    return (
        held + limits.blocks_for(request.total_tokens) <= limits.kv_blocks
        and len(kept) < limits.max_running
        and tokens + (request.prompt_tokens if whole else 1) <= limits.step_tokens
    )


@dataclass
class Run:
    plans: list[StepPlan] = field(default_factory=list)
    urgent_checked: int = 0  # urgent arrivals asserted to start at the next step
    urgent_preempting: int = 0  # of those, ones that preempted to start
    cached_tokens: int = 0  # prompt tokens found in the cache, not computed


def simulate(limits: GenerationLimits, seed: int, requests: int = 400) -> Run:
    rng = random.Random(seed)
    scheduler = GenerationScheduler(limits, step_prior=LinearFit(0.002, 2e-5))
    runtime = Runtime(limits, rng)
    jobs = runtime.jobs
    ended: dict[str, FinishReason] = {}
    accepted: list[str] = []
    ever_admitted: set[str] = set()
    running: set[str] = set()
    cancel_asked: set[str] = set()
    result = Run()
    now, arrived, next_arrival = 0.0, 0, 0.0
    for _ in range(100_000):
        urgent_new: list[GenerationRequest] = []
        while arrived < requests and next_arrival <= now:
            request = new_request(rng, arrived, next_arrival, limits.block_size)
            arrived += 1
            next_arrival += rng.expovariate(ARRIVALS_PER_S)
            never = limits.blocks_for(request.total_tokens) > limits.kv_blocks or (
                limits.prefill_chunk_tokens == 0 and request.prompt_tokens > limits.step_tokens
            )
            try:
                scheduler.add(request)
            except ValueError:
                assert never, request
                continue
            assert not never, request
            accepted.append(request.id)
            jobs[request.id] = Job(request, target=max(1, int(8 * rng.paretovariate(0.8))))
            if request.lane is Lane.URGENT:
                urgent_new.append(request)
        # Ended by the scheduler at its max_tokens is ended, though reported in the next plan.
        gone = set(ended) | cancel_asked | runtime.unreported
        live = [id for id in accepted if id not in gone]
        if live and rng.random() < 0.05:
            id = rng.choice(live)
            assert scheduler.cancel(id)
            cancel_asked.add(id)
        # Urgent arrivals that preempting could make room for start at this very step.
        # (Waiting: not running, so a preempted urgent one, which heads the lane, too.)
        urgent_waiting = (
            {id for id in accepted if jobs[id].request.lane is Lane.URGENT}
            - running
            - set(ended)
            - cancel_asked
            - runtime.unreported
        )
        must_start = [
            request.id
            for request in urgent_new
            if urgent_waiting == {request.id}
            and urgent_can_fit(limits, request, jobs, running - cancel_asked)
        ]

        plan = scheduler.schedule(now)
        result.plans.append(plan)
        check_plan(plan, limits)
        for id in must_start:
            assert id in plan.admitted, f"urgent {id} did not start at once"
        result.urgent_checked += len(must_start)
        result.urgent_preempting += len(must_start) if plan.preempted else 0
        assert not set(plan.admitted) & ever_admitted, "admitted twice"
        assert set(plan.resumed) <= ever_admitted and not set(plan.expired) & ever_admitted
        ever_admitted |= set(plan.admitted)
        running -= {*plan.released, *plan.preempted}
        running |= {*plan.admitted, *plan.resumed}
        for id, reason in [
            *plan.ended.items(),
            *((id, FinishReason.EXPIRED) for id in plan.expired),
        ]:
            assert id not in ended, f"{id} ended twice"
            ended[id] = reason

        runtime.apply_blocks(plan)
        owned = scheduler.owned_blocks()
        assert {id: sorted(blocks) for id, blocks in owned.items()} == {
            id: sorted(job.table) for id, job in jobs.items() if job.table
        }
        result.cached_tokens += sum(plan.cached.values())
        assert scheduler.blocks_free == limits.kv_blocks - len(runtime.owner)
        assert scheduler.running_count == len(running) <= limits.max_running
        output = runtime.compute(plan)
        scheduler.update_from_output(plan, output, now + output.step_s)
        for id, reason in output.finished.items():
            assert id not in ended, f"{id} ended twice"
            ended[id] = reason
        running -= set(output.finished) | runtime.unreported
        for id in running:
            assert scheduler.state_of(id) == "running"

        if plan.empty:
            if arrived == requests and scheduler.waiting_count == 0:
                break
            now = max(now, next_arrival)
        else:
            now += output.step_s
    else:
        pytest.fail("the simulation did not drain")
    assert sorted(ended) == sorted(accepted), "every request ends exactly once"
    assert {ended[id] for id in cancel_asked} <= {
        FinishReason.CANCELLED,
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.EXPIRED,
    }
    assert scheduler.blocks_free == limits.kv_blocks and not runtime.owner
    return result


def check_plan(plan: StepPlan, limits: GenerationLimits) -> None:
    """No sequence in two places in one plan, and the token budget holds."""
    chunks = [chunk.id for chunk in plan.prefill]
    computing = set(chunks) | set(plan.decode)
    assert len(chunks) == len(set(chunks)) and not set(chunks) & set(plan.decode)
    assert plan.tokens <= limits.step_tokens
    assert not set(plan.preempted) & computing
    assert not set(plan.released) & (computing | set(plan.preempted))
    assert not set(plan.expired) & (computing | set(plan.preempted) | set(plan.released))
    assert not set(plan.admitted) & set(plan.resumed)
    assert set(plan.admitted) | set(plan.resumed) <= set(chunks)
    assert set(plan.blocks) == set(plan.admitted) | set(plan.resumed)
    assert set(plan.released) <= set(plan.ended)
    if limits.prefill_chunk_tokens:
        assert all(chunk.length <= limits.prefill_chunk_tokens for chunk in plan.prefill)


LIMITS = {
    "chunked": GenerationLimits(
        kv_blocks=96, block_size=8, max_running=16, step_tokens=128, prefill_chunk_tokens=32
    ),
    "whole prompts": GenerationLimits(
        kv_blocks=128, block_size=8, max_running=12, step_tokens=256, prefill_chunk_tokens=0
    ),
}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(LIMITS))
def test_a_random_load_keeps_every_invariant(name: str, seed: int) -> None:
    run = simulate(LIMITS[name], seed)
    plans = run.plans
    # The load exercised the rules, not just the easy path.
    assert run.urgent_checked > 0 and run.urgent_preempting > 0
    assert run.cached_tokens > 1000  # prompts shared their system prompt's blocks
    assert sum(len(plan.preempted) for plan in plans) > 0
    assert sum(len(plan.expired) for plan in plans) > 0
    assert sum(len(plan.resumed) for plan in plans) > 0
    assert any(len(plan.prefill) > 1 and plan.decode for plan in plans)


def test_the_same_calls_make_the_same_plans() -> None:
    limits = LIMITS["chunked"]
    assert simulate(limits, 7, requests=150).plans == simulate(limits, 7, requests=150).plans
