"""What a generation model's workers learned, and the wait the API quotes from it.

A generation worker publishes into its model's stats hash (the one encoder
workers fill with :class:`~core.models.estimates.ModelEstimate`) its learned step
time (seconds ~ a + b x a step's tokens), its KV pool, its per-step budgets,
the sizes of the jobs it saw lately and how it runs the model
(:class:`GenerationEstimate`, its own fields: an encoder's hash never has
them, nor a generation's an encoder's). The API turns that and the depth of
the queue ahead into a job's ``estimated_wait_ms``: the time until its first
token (:func:`first_token_s`); and into the time until it ends, were it to
run to its ``max_tokens`` (:func:`finish_s`), which is what its deadline
bounds (queue, prefill and decode).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

Execution = Literal["step", "generate"]
EXECUTIONS: tuple[Execution, ...] = ("step", "generate")


@dataclass(frozen=True)
class GenerationEstimate:
    """A generation model's learned step time, its limits, and the usual job.

    ``execution``: ``step`` (natively stepped: sequences join and leave any
    step) or ``generate`` (the library's ``generate()``: a step runs the
    sequences it admits to their end), with ``why`` for the latter.
    ``step_a_s``, ``step_b_s``: a step's seconds ~ a + b x its tokens.
    ``kv_blocks`` of ``block_size`` tokens, ``bytes_per_block`` each: the KV pool.
    ``max_running``, ``step_tokens``, ``prefill_chunk_tokens``: the scheduler's limits.
    ``running``, ``waiting``: sequences in the worker when it published.
    ``mean_prompt_tokens``, ``mean_max_tokens``: recent jobs' sizes;
    ``mean_completion_tokens``: what recent jobs generated (0: none seen yet).
    ``prefix_caching``: prompts that begin alike share their prefix's KV blocks (read
    when given: a worker of an earlier version publishes no such field).
    """

    execution: Execution
    why: str
    step_a_s: float
    step_b_s: float
    kv_blocks: int
    block_size: int
    bytes_per_block: int
    max_running: int
    step_tokens: int
    prefill_chunk_tokens: int
    running: int = 0
    waiting: int = 0
    mean_prompt_tokens: float = 0.0
    mean_max_tokens: float = 0.0
    mean_completion_tokens: float = 0.0
    prefix_caching: bool = False

    def step_s(self, tokens: float) -> float:
        return self.step_a_s + self.step_b_s * tokens if tokens > 0 else 0.0

    def blocks_for(self, tokens: float) -> int:
        return math.ceil(tokens / self.block_size)

    def to_hash(self) -> dict[str, str]:
        return {
            f.name: value if isinstance(value, str) else repr(value)
            for f in fields(self)
            for value in [getattr(self, f.name)]
        }

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> GenerationEstimate | None:
        """``None`` until a generation worker has published every field (an encoder's hash
        has none of them)."""
        try:
            execution = raw["execution"]
            if execution not in EXECUTIONS:
                return None
            numbers = {
                f.name: float(raw[f.name])
                for f in fields(cls)
                if f.name not in ("execution", "why", "prefix_caching")
            }
        except (KeyError, ValueError):
            return None
        ints = {
            "kv_blocks",
            "block_size",
            "bytes_per_block",
            "max_running",
            "step_tokens",
            "prefill_chunk_tokens",
            "running",
            "waiting",
        }
        values = {name: int(v) if name in ints else v for name, v in numbers.items()}
        for name in ("kv_blocks", "block_size", "max_running", "step_tokens"):
            values[name] = max(1, values[name])
        return cls(
            execution=execution,
            why=raw.get("why", ""),
            prefix_caching=raw.get("prefix_caching") == "True",
            **values,  # type: ignore[arg-type]
        )


def first_token_s(
    est: GenerationEstimate, ahead: int, prompt_tokens: int, max_tokens: int, workers: int = 1
) -> float:
    """Seconds from acceptance to the first token of a job behind ``ahead`` jobs.

    The jobs ahead are the usual job (the published means; before any, this
    one's size) shared among the live workers. Stepped natively: the job starts
    once enough of those ahead have finished to free a slot and its KV blocks
    (at once if there is room), those running together finishing about evenly;
    each step carries at most ``step_tokens`` and one decode token per running
    sequence. Those ahead that the worker had not started when it published
    prefill before it (in the drain's steps when some must end first). Then,
    after the step in flight, it prefills its prompt in chunks beside the
    others and samples its first token at the last chunk.
    Through ``generate()``: the jobs ahead run in whole batches, and its first
    token comes when its own batch ends.
    """
    per_worker = ahead / max(workers, 1)
    prompt = est.mean_prompt_tokens if est.mean_prompt_tokens >= 1 else float(prompt_tokens)
    maximum = est.mean_max_tokens if est.mean_max_tokens >= 1 else float(max_tokens)
    # Nothing finished yet: assume the usual job runs to its max_tokens.
    completion = est.mean_completion_tokens if est.mean_completion_tokens >= 1 else maximum
    job_blocks = max(1, est.blocks_for(prompt + maximum))
    together = max(1, min(est.max_running, est.kv_blocks // job_blocks))
    if est.execution == "generate":
        return _whole_batches_s(est, per_worker, prompt, prompt_tokens, together)

    need = est.blocks_for(prompt_tokens + max_tokens)
    room_slots = est.max_running - per_worker
    room_blocks = est.kv_blocks - per_worker * job_blocks
    short = max(0.0, 1 - room_slots, (need - room_blocks) / job_blocks)
    finished = min(per_worker, math.ceil(short - 1e-9))  # jobs ahead that must end first
    beside = min(together - 1, per_worker)
    # Of those running beside it, the ones that had not started when the worker last
    # published (a burst: the worker has not seen them yet) still have their prompts to
    # prefill, and are admitted and prefilled before it. (Measured through the stack,
    # bench/generation_stack.py: without this term a burst's quotes were a tenth of the
    # waits for its first tokens.)
    fresh = min(max(0.0, per_worker - est.running), beside)
    in_flight_s = est.step_s(min(est.step_tokens, beside)) if per_worker > 0 else 0.0
    # With room now, their prompts and then its own, in the step budget the decodes leave.
    wait_s = _prefill_s(est, fresh * prompt, prompt_tokens, beside - fresh)
    if finished > 0:
        # Their prefills share the steps of the drain with those ending; by the time this
        # job is admitted they decode beside it. The drain takes no less than their
        # prefills would with room (so the drain's start does not shorten the quote).
        work = finished * (prompt + completion) + fresh * prompt
        steps = max(work / est.step_tokens, finished * completion / together)
        drain_s = steps * est.step_s(work / steps)
        wait_s = max(wait_s, drain_s + _prefill_s(est, 0.0, prompt_tokens, beside))
    return in_flight_s + wait_s


def _prefill_s(
    est: GenerationEstimate, ahead_tokens: float, prompt_tokens: int, decoding: float
) -> float:
    """Prefilling ``ahead_tokens`` of others' prompts, then a prompt of its own in chunks,
    in the steps' budget beside ``decoding`` sequences: in no fewer steps than its chunks."""
    prefill = ahead_tokens + prompt_tokens
    chunk = max(1, est.prefill_chunk_tokens or prompt_tokens)
    budget = max(1.0, est.step_tokens - decoding)
    steps = max(prefill / budget, math.ceil(prompt_tokens / chunk), 1)
    return steps * est.step_s(min(est.step_tokens, prefill / steps + decoding))


def finish_s(
    est: GenerationEstimate, ahead: int, prompt_tokens: int, max_tokens: int, workers: int = 1
) -> float:
    """Seconds from acceptance to the end of a job that runs to its ``max_tokens``: its
    first token (:func:`first_token_s`), then a decode step for each token after it.

    A decode step carries one token for this job and one for each sequence
    running beside it. Through ``generate()`` a job's tokens all come when
    its batch ends, with its first.
    """
    first = first_token_s(est, ahead, prompt_tokens, max_tokens, workers)
    if est.execution == "generate":
        return first
    return first + (max_tokens - 1) * decode_step_s(est, ahead, max_tokens, workers)


def decode_step_s(est: GenerationEstimate, ahead: int, max_tokens: int, workers: int = 1) -> float:
    """A decode step's seconds while the job runs beside those the queue ahead starts."""
    per_worker = ahead / max(workers, 1)
    prompt = est.mean_prompt_tokens if est.mean_prompt_tokens >= 1 else 1.0
    maximum = est.mean_max_tokens if est.mean_max_tokens >= 1 else float(max_tokens)
    together = max(
        1, min(est.max_running, est.kv_blocks // max(1, est.blocks_for(prompt + maximum)))
    )
    beside = min(together - 1, max(per_worker, float(est.running)))
    return est.step_s(min(est.step_tokens, beside + 1))


def most_tokens_within(
    est: GenerationEstimate,
    ahead: int,
    prompt_tokens: int,
    max_tokens: int,
    deadline_s: float,
    workers: int = 1,
) -> int:
    """The largest ``max_tokens`` (at most the one asked for) with which the job is predicted
    to end within ``deadline_s``; 0 when not even its first token is."""
    first = first_token_s(est, ahead, prompt_tokens, max_tokens, workers)
    if first > deadline_s:
        return 0
    if est.execution == "generate":
        return max_tokens
    step = decode_step_s(est, ahead, max_tokens, workers)
    if step <= 0:
        return max_tokens
    return min(max_tokens, 1 + math.floor((deadline_s - first) / step))


def _whole_batches_s(
    est: GenerationEstimate, per_worker: float, prompt: float, own_prompt: int, together: int
) -> float:
    """``generate()`` runs each admitted batch to its end in one step (whole prompts within
    ``step_tokens``): the full batches ahead, then its own with what is left."""
    per_batch = max(1, min(together, int(est.step_tokens // max(prompt, 1.0))))
    batches, left = divmod(per_worker, per_batch)
    own = min(est.step_tokens, left * prompt + own_prompt)
    return batches * est.step_s(per_batch * prompt) + est.step_s(own)
