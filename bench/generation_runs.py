"""The three ways the generation benchmark runs one workload, each on the real clock.

* :func:`run_ferry`: Ferry's engine (``GenerationScheduler`` and the
  ``causal-lm`` backend's step runtime, paged KV), stepped in a loop; each
  request is added the first step after its arrival time.
* :func:`run_generate` with ``size`` B: static batching as a user writes it:
  requests in arrival order, B a batch, each batch one ``model.generate()``
  with left padding and ``max_new_tokens`` its longest member's; a batch
  starts once its last member has arrived and the batch before it is done.
  Each member counts only its own ``max_tokens``; its first token is the
  batch's first step, its last the step that produced its own last token (as
  a streamer would hand them out).
* :func:`run_generate` with ``size`` 1: one request at a time, in arrival order.

End-of-sequence never ends a request: the step runtime is given no EOS ids
and ``generate()`` none, so every request generates exactly ``max_tokens``
in all three (a random-weight model hits EOS at random, which would make the
three runs do different work).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from backends.generation.runtime import Completion, GenerationInput, StepResult
from bench.generation_workload import Record, Request, static_batches
from scheduler.generation import (
    FinishReason,
    GenerationLimits,
    GenerationRequest,
    GenerationScheduler,
    StepPlan,
)
from scheduler.generation_state import prefix_hashes
from workers.gpu.engine import GenerationEngine


class StepClock(LogitsProcessor):
    """Records when each generation step's logits are ready (the step's token's time)."""

    def __init__(self, device: str) -> None:
        self.times: list[float] = []
        self.cuda = device.startswith("cuda")

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            torch.cuda.synchronize()  # the logits are computed, not only queued
        self.times.append(time.perf_counter())
        return scores


def run_generate(
    model: Any, requests: Sequence[Request], size: int, pad_id: int, device: str
) -> list[Record]:
    """Static batches of ``size`` through ``model.generate()`` (``size`` 1: one at a time)."""
    records: list[Record] = []
    start = time.perf_counter()
    for batch in static_batches(requests, size):
        ready_s = max(r.arrival_s for r in batch)
        wait_s = ready_s - (time.perf_counter() - start)
        if wait_s > 0:
            time.sleep(wait_s)
        width = max(len(r.prompt_ids) for r in batch)
        rows = [[pad_id] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in batch]
        masks = [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch]
        new_tokens = max(r.max_tokens for r in batch)
        clock = StepClock(device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor(rows, device=device),
                attention_mask=torch.tensor(masks, device=device),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,  # never stop early: every member runs to its max_tokens
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        if out.shape[1] - width != new_tokens or len(clock.times) != new_tokens:
            raise RuntimeError(
                f"generate() made {out.shape[1] - width} tokens in {len(clock.times)} steps, "
                f"asked for {new_tokens}: it stopped early"
            )
        times = [t - start for t in clock.times]
        for r in batch:
            records.append(Record(r.arrival_s, times[0], times[r.max_tokens - 1], r.max_tokens))
    return records


class WatchedRunner:
    """The step runtime, with what the benchmark watches at each step: the KV blocks the
    scheduler has given out while the step computes (its peak), and the step's seconds."""

    def __init__(self, runner: Any, scheduler: GenerationScheduler) -> None:
        self.runner = runner
        self.resumable = bool(runner.resumable)
        self.scheduler = scheduler
        self.peak_blocks = 0
        self.execute_s: list[float] = []
        self.step_tokens: list[int] = []
        self.cached_tokens = 0  # prompt tokens found in the cache, not computed

    def add(self, id: str, job: GenerationInput) -> None:
        self.runner.add(id, job)

    def holds(self, id: str) -> bool:
        return bool(self.runner.holds(id))

    def reset(self, id: str) -> None:
        self.runner.reset(id)

    def clear(self) -> None:
        self.runner.clear()

    def pop(self, id: str, reason: FinishReason) -> Completion:
        completion: Completion = self.runner.pop(id, reason)
        return completion

    def execute(self, plan: StepPlan) -> StepResult:
        used = self.scheduler.blocks_used
        if used > self.scheduler.limits.kv_blocks:
            raise AssertionError(
                f"{used} KV blocks in use, the pool has {self.scheduler.limits.kv_blocks}"
            )
        self.peak_blocks = max(self.peak_blocks, used)
        self.cached_tokens += sum(plan.cached.values())
        started = time.perf_counter()
        result: StepResult = self.runner.execute(plan)
        if not plan.empty:
            self.execute_s.append(time.perf_counter() - started)
            self.step_tokens.append(sum(c.length for c in plan.prefill) + len(plan.decode))
        return result


@dataclass
class FerryRun:
    """A Ferry run's records, with each request's token times and what the engine did."""

    records: dict[str, Record]
    token_times_s: dict[str, list[float]]
    peak_blocks: int
    kv_blocks: int
    steps: int
    step_s: list[float] = field(default_factory=list)  # engine.step, whole
    execute_s: list[float] = field(default_factory=list)  # the runtime's part of it
    step_tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0

    def figures(self) -> dict[str, Any]:
        running = self.step_s
        return {
            "peak_kv_blocks": self.peak_blocks,
            "kv_blocks": self.kv_blocks,
            "steps": self.steps,
            "step_ms_mean": round(1000.0 * sum(running) / len(running), 2) if running else None,
            "computed_tokens": sum(self.step_tokens),
            "cached_tokens": self.cached_tokens,
        }


def run_ferry(
    runner: Any,
    limits: GenerationLimits,
    requests: Sequence[Request],
    prefix_caching: bool = False,
) -> FerryRun:
    """The workload through a fresh scheduler on ``runner``, stepped on the real clock;
    ``prefix_caching``: each request names its prompt's prefix blocks, as the worker
    does by default."""
    scheduler = GenerationScheduler(limits)
    watched = WatchedRunner(runner, scheduler)
    engine = GenerationEngine(scheduler, watched)
    pending = sorted(requests, key=lambda r: r.arrival_s)
    by_id = {r.id: r for r in requests}
    times: dict[str, list[float]] = {r.id: [] for r in requests}
    step_s: list[float] = []
    ended, next_up, steps = 0, 0, 0
    start = time.perf_counter()
    while ended < len(pending):
        now = time.perf_counter() - start
        while next_up < len(pending) and pending[next_up].arrival_s <= now:
            r = pending[next_up]
            prefix = prefix_hashes(r.prompt_ids, limits.block_size) if prefix_caching else ()
            engine.add(
                GenerationRequest(
                    r.id, len(r.prompt_ids), r.max_tokens, arrival=r.arrival_s, prefix=prefix
                ),
                GenerationInput(r.prompt_ids, r.max_tokens),
            )
            next_up += 1
        if scheduler.running_count == 0 and scheduler.waiting_count == 0:
            time.sleep(max(0.0, pending[next_up].arrival_s - now))
            continue
        events = engine.step(now)
        done = time.perf_counter() - start
        if not events.plan.empty:
            steps += 1
            step_s.append(done - now)
        for id in events.emitted:
            times[id].append(done)
        for id, completion in events.ended.items():
            if completion.finish_reason != FinishReason.LENGTH:
                raise RuntimeError(f"{id} ended {completion.finish_reason}, not at its max_tokens")
            ended += 1
    records = {}
    for id, seen in times.items():
        r = by_id[id]
        if len(seen) != r.max_tokens:
            raise RuntimeError(f"{id}: {len(seen)} tokens, asked for {r.max_tokens}")
        records[id] = Record(r.arrival_s, seen[0], seen[-1], len(seen))
    return FerryRun(
        records=records,
        token_times_s=times,
        peak_blocks=watched.peak_blocks,
        kv_blocks=limits.kv_blocks,
        steps=steps,
        step_s=step_s,
        execute_s=watched.execute_s,
        step_tokens=watched.step_tokens,
        cached_tokens=watched.cached_tokens,
    )
