"""Causal LMs Ferry does not step natively: the library's ``generate()`` on whole batches.

The scheduler still chooses which jobs run together (lanes, tenants, the
KV budget, deadlines), but every sequence admitted in a step is prefilled
and decoded to its end inside that step: a batch is held for its longest
member, as a user's own ``generate()`` loop holds it. ``GET /v1/models``
says ``execution: generate`` for such a model.

Sequences that sample differently (temperature, top-p, penalties, bias) run as separate
``generate()`` calls; a seed makes a job reproducible only beside the same
neighbours, since one batch shares one random stream.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from backends.generation.detok import Detokenizer
from backends.generation.runtime import (
    SCORE_ROWS,
    Completion,
    Emitted,
    GenerationInput,
    StepResult,
    TokenLogprob,
    token_logprobs,
)
from backends.generation.sampling import SamplingParams, adjusted
from scheduler.generation import FinishReason, StepOutput, StepPlan


@dataclass(eq=False)
class WholeRuntime:
    """``generate()`` over the sequences a step admits, each run to its end."""

    asynchronous = False
    padded = True
    # A job runs whole in one step, streamed only when it ends: there is never a
    # part of it to go on from, and a job taken over runs again from its prompt.
    resumable = False
    prefix_caching = False  # generate() keeps no KV between calls

    name: str
    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    eos_ids: Sequence[int]
    device: str
    kv_blocks: int
    block_size: int
    _jobs: dict[str, GenerationInput] = field(init=False, repr=False, default_factory=dict)
    _done: dict[str, Completion] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.eos_ids = tuple(self.eos_ids)

    def add(self, id: str, job: GenerationInput) -> None:
        self._jobs[id] = job

    def holds(self, id: str) -> bool:
        return id in self._jobs or id in self._done

    def clear(self) -> None:
        """Forget every job (the scheduler was reset)."""
        self._jobs.clear()
        self._done.clear()

    def reset(self, id: str) -> None:
        """A step that raised: forget what it generated for ``id`` (it runs again whole)."""
        self._done.pop(id, None)

    def tokens(self, id: str) -> tuple[int, ...]:
        done = self._done.get(id)
        return done.token_ids if done else ()

    def pop(self, id: str, reason: FinishReason) -> Completion:
        done = self._done.pop(id, None)
        job = self._jobs.pop(id)
        if done is None:
            return Completion("", (), reason, len(job.prompt_ids), job.sampling.seed)
        return replace(done, finish_reason=reason)

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        ids = [chunk.id for chunk in plan.prefill if chunk.last]
        groups: dict[SamplingParams, list[str]] = {}
        for id in ids:
            sampling = self._jobs[id].sampling
            groups.setdefault(replace(sampling, seed=None), []).append(id)
        sampled: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        emitted: dict[str, Emitted] = {}
        for members in groups.values():
            for id, completion in zip(members, self._generate(members), strict=True):
                self._done[id] = completion
                finished[id] = completion.finish_reason
                if completion.token_ids:
                    sampled[id] = completion.token_ids[-1]
                    emitted[id] = Emitted(completion.token_ids[-1], completion.text)
        output = StepOutput(sampled, finished, step_s=time.perf_counter() - started)
        return StepResult(output, emitted)

    def _generate(self, members: list[str]) -> list[Completion]:
        jobs = [self._jobs[id] for id in members]
        longest = max(len(job.prompt_ids) for job in jobs)
        pad = self.eos_ids[0] if self.eos_ids else 0
        # Left padding, as generate() needs for a decoder-only batch.
        input_ids = torch.tensor(
            [[pad] * (longest - len(j.prompt_ids)) + list(j.prompt_ids) for j in jobs],
            device=self.device,
        )
        mask = torch.tensor(
            [[0] * (longest - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs],
            device=self.device,
        )
        sampling = jobs[0].sampling
        # The processors in the order Ferry's own sampler applies them (the library's
        # add theirs first and a caller's after; its default top-k is not Ferry's).
        processors = LogitsProcessorList()
        if sampling.adjusts:
            processors.append(_Adjust(sampling, longest))
        options: dict[str, Any] = {"do_sample": not sampling.greedy}
        if not sampling.greedy:
            options.update(temperature=1.0, top_p=1.0, top_k=0)
            if sampling.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_p < 1.0:
                processors.append(TopPLogitsWarper(sampling.top_p))
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        wanted = any(job.logprobs is not None for job in jobs)
        if wanted:
            # The model's own logits at each step (before any processor), for logprobs.
            options.update(output_logits=True, return_dict_in_generate=True)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max(j.max_tokens for j in jobs),
                pad_token_id=pad,
                eos_token_id=list(self.eos_ids) or None,
                logits_processor=processors,
                **options,
            )
        sequences, steps = (out.sequences, out.logits) if wanted else (out, ())
        completions = []
        for i, (row, job) in enumerate(zip(sequences[:, longest:].tolist(), jobs, strict=True)):
            tokens: list[int] = []
            reason = FinishReason.LENGTH
            for token in row[: job.max_tokens]:
                tokens.append(token)
                if token in self.eos_ids:
                    reason = FinishReason.STOP
                    break
            detok = Detokenizer(self.tokenizer, job.stop)
            for token in tokens:
                if token not in self.eos_ids:
                    detok.push(token)
            detok.finish()
            if detok.stopped:
                reason = FinishReason.STOP
            logprobs = None
            if job.logprobs is not None:
                rows = torch.stack([steps[t][i] for t in range(len(tokens))])
                found = token_logprobs(
                    rows, dict.fromkeys(range(len(tokens)), job.logprobs), tokens
                )
                logprobs = tuple(found[t] for t in range(len(tokens)))
            completions.append(
                Completion(
                    detok.text,
                    tuple(tokens),
                    reason,
                    len(job.prompt_ids),
                    sampling.seed,
                    logprobs,
                    self._scored(job),
                    () if job.prompt_logprobs is None else job.prompt_ids,
                )
            )
        return completions

    def _scored(self, job: GenerationInput) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt's own log probabilities, when asked: one forward of the prompt alone
        (``generate()`` returns no logits for the prompt's positions)."""
        if job.prompt_logprobs is None:
            return None
        prompt = list(job.prompt_ids)
        entries: list[TokenLogprob | None] = [None]
        # Prefilled SCORE_ROWS positions a forward, each on the KV of those before it (the
        # model's own head, whatever it does to its logits): no forward holds a whole long
        # prompt's logits, and none computes a position twice.
        past: Any = None
        for start in range(0, len(prompt) - 1, SCORE_ROWS):
            end = min(start + SCORE_ROWS, len(prompt) - 1)
            with torch.inference_mode():
                out = self.model(
                    input_ids=torch.tensor([prompt[start:end]], device=self.device),
                    cache=past,
                    use_cache=True,
                )
            past = out.cache
            found = token_logprobs(
                out.logits[0],
                dict.fromkeys(range(end - start), job.prompt_logprobs),
                prompt[start + 1 : end + 1],
            )
            entries += [found[i] for i in range(end - start)]
        return tuple(entries)


class _Adjust(LogitsProcessor):
    """The bias and penalties of ``backends.generation.sampling``, on each row's tokens
    after the (left-padded) prompts."""

    def __init__(self, params: SamplingParams, prompt_width: int) -> None:
        self.params = params
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = [
            adjusted(row, self.params, generated)
            for row, generated in zip(
                scores, input_ids[:, self.prompt_width :].tolist(), strict=True
            )
        ]
        return torch.stack(rows).to(scores.dtype)  # type: ignore[return-value]
