"""Step-level execution of a causal LM: one call runs one scheduler step.

The scheduler (``scheduler.generation``) decides each step; this runtime
holds what the device needs to carry it out: every sequence's tokens, its
block table into the paged KV pool, its sampler and its detokenizer. A step
packs every scheduled token (decodes and prefill chunks) into one forward
pass of the library's own model, with the paged attention of
``backends.generation.paged``, and samples one token for each sequence the
plan names in ``sampling``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from backends.generation import paged
from backends.generation.detok import Detokenizer
from backends.generation.sampling import Sampler, SamplingParams
from scheduler.generation import FinishReason, StepOutput, StepPlan

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)
# A scored prompt's positions get their logits this many at a time, from the final hidden
# states: a whole prefill chunk's (up to step_tokens rows of the vocabulary's width, then
# in float32 for the softmax) would be gigabytes on a large vocabulary, outside the KV
# pool's budget.
SCORE_ROWS = 128


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model's own distribution (the
    logits before any bias, penalty or temperature), and the ``k`` likeliest tokens
    there with theirs, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationInput:
    """One job, as the runtime takes it: the prompt's token ids and how to continue."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    # Tokens it generated before, elsewhere (a generation taken over after its
    # worker died): it goes on from them, and they count towards max_tokens.
    resumed: tuple[int, ...] = ()
    # The token after ``resumed`` that a client was already shown (the last one the stream
    # holds): computed again, as the sequence may end there, and kept as it was shown, as
    # the computation (from a prefill where it came from a decode) may round otherwise in
    # reduced precision.
    shown: int | None = None
    # Each token's log probability, and the ``logprobs`` likeliest alternatives' (None:
    # not asked); ``resumed_logprobs``: those of the ``resumed`` tokens, as streamed.
    logprobs: int | None = None
    resumed_logprobs: tuple[TokenLogprob, ...] = ()
    # Each prompt token's log probability given the tokens before it, and the
    # ``prompt_logprobs`` likeliest tokens at its place (None: not asked): a prompt scored.
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class Emitted:
    """What one sequence produced in a step: its token, the text it makes visible and,
    when its job asked, the token's log probability."""

    token: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Completion:
    """A sequence's result once it has ended."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    seed: int | None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when asked
    # One per prompt token, when asked; the first None (nothing comes before it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    prompt_ids: tuple[int, ...] = ()  # the prompt, when its logprobs were asked


@dataclass(frozen=True)
class StepResult:
    """A step's output for the scheduler, and each sequence's new token and text."""

    output: StepOutput
    emitted: Mapping[str, Emitted]


class _Sequence:
    def __init__(self, job: GenerationInput, tokenizer: Any, device: str) -> None:
        self.job = job
        self.tokens = list(job.prompt_ids) + list(job.resumed)
        self.generated: list[int] = list(job.resumed)
        self.sampler = Sampler(job.sampling, device)
        self.detok = Detokenizer(tokenizer, job.stop)
        for token in job.resumed:  # the text so far, as it was shown
            self.detok.push(token)
        self.table: list[int] = []
        self.table_tensor: torch.Tensor | None = None
        self.finish: FinishReason | None = None
        self.shown = job.shown
        self.logprobs: list[TokenLogprob] | None = (
            None if job.logprobs is None else list(job.resumed_logprobs)
        )
        # By prompt position: a prompt prefilled again (preempted, a step that raised,
        # taken over) computes the same entries again.
        self.prompt_logprobs: dict[int, TokenLogprob] = {}

    def prompt_logprobs_found(self) -> tuple[TokenLogprob | None, ...] | None:
        """Every prompt position's entry (None for the first); None when not asked, or
        when the prompt was not all computed (the job ended during its prefill)."""
        positions = range(len(self.job.prompt_ids) - 1)
        if self.job.prompt_logprobs is None or any(
            p not in self.prompt_logprobs for p in positions
        ):
            return None
        return (None, *(self.prompt_logprobs[p] for p in positions))


def token_logprobs(
    logits: torch.Tensor, asked: Mapping[int, int], chosen: Sequence[int]
) -> dict[int, TokenLogprob]:
    """For each row of ``asked`` (its number of alternatives), the log probability of
    its chosen token and its likeliest ones, from the rows' logits as the model gave
    them: one softmax and one copy to the host for all of them."""
    if not asked:
        return {}
    rows = list(asked)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    picked = logprobs[torch.arange(len(rows)), torch.tensor([chosen[r] for r in rows])].tolist()
    widest = max(asked.values())
    top_values, top_ids = (
        logprobs.topk(widest, dim=-1) if widest else (logprobs[:, :0], logprobs[:, :0].long())
    )
    values, ids = top_values.tolist(), top_ids.tolist()
    return {
        row: TokenLogprob(
            chosen[row],
            picked[i],
            tuple(zip(ids[i][: asked[row]], values[i][: asked[row]], strict=True)),
        )
        for i, row in enumerate(rows)
    }


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy on the logits as they are: chosen with the step's other such rows at once."""
    return params.greedy and not params.adjusts


class StepRuntime:
    """A causal LM the scheduler steps: load once, then ``execute(plan)`` each step."""

    asynchronous = False
    padded = False
    resumable = True  # a job may start from tokens it generated elsewhere (``resumed``)

    def __init__(
        self,
        name: str,
        model: Any,
        tokenizer: Any,
        eos_ids: Sequence[int],
        device: str,
        kv_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        prefix_caching: bool = True,
    ) -> None:
        self.name = name
        # Whether requests name their prompt's prefix blocks (the scheduler shares them):
        # a sequence only reads the blocks before its first chunk, so nothing here changes.
        self.prefix_caching = prefix_caching
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.device = device
        self.block_size = block_size
        self.shape = paged.KVShape.of(model.config, dtype)
        self.pool = paged.KVPool(self.shape, kv_blocks, block_size, device)
        self._sequences: dict[str, _Sequence] = {}
        # Decoding sequences attend in one padded call on a GPU, where a call per
        # sequence per layer is thousands of kernel launches a step; on the CPU a
        # call each is faster (measured: about 1.5x at 32 sequences, no padding).
        self.batched_decode = device.startswith("cuda")

    @property
    def kv_blocks(self) -> int:
        return self.pool.blocks

    def add(self, id: str, job: GenerationInput) -> None:
        """Hold a sequence's tokens until the scheduler runs it (nothing on the device yet)."""
        self._sequences[id] = _Sequence(job, self.tokenizer, self.device)

    def holds(self, id: str) -> bool:
        return id in self._sequences

    def clear(self) -> None:
        """Forget every sequence (the scheduler was reset: their blocks are free)."""
        self._sequences.clear()

    def reset(self, id: str) -> None:
        """A step that raised: forget ``id``'s KV (its tokens stay; it prefills them again)."""
        sequence = self._sequences[id]
        sequence.table = []
        sequence.table_tensor = None

    def tokens(self, id: str) -> tuple[int, ...]:
        """What ``id`` has generated so far."""
        return tuple(self._sequences[id].generated)

    def pop(self, id: str, reason: FinishReason) -> Completion:
        """Forget an ended sequence, returning its result (its blocks are the scheduler's again)."""
        sequence = self._sequences.pop(id)
        text = sequence.detok.text if sequence.detok.stopped else None
        if text is None:
            sequence.detok.finish()
            text = sequence.detok.text
        return Completion(
            text=text,
            token_ids=tuple(sequence.generated),
            finish_reason=reason,
            prompt_tokens=len(sequence.job.prompt_ids),
            seed=None if sequence.job.sampling.greedy else sequence.sampler.seed,
            logprobs=None if sequence.logprobs is None else tuple(sequence.logprobs),
            prompt_logprobs=sequence.prompt_logprobs_found(),
            prompt_ids=() if sequence.job.prompt_logprobs is None else sequence.job.prompt_ids,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Carry out one step of the scheduler's plan."""
        started = time.perf_counter()
        for id in plan.preempted:
            sequence = self._sequences[id]
            sequence.table = []
            sequence.table_tensor = None
        for id, blocks in plan.blocks.items():
            sequence = self._sequences[id]
            sequence.table.extend(blocks)
            sequence.table_tensor = None
        if plan.empty:
            return StepResult(StepOutput(step_s=time.perf_counter() - started), {})
        ids: list[int] = []
        positions: list[int] = []
        segments: list[paged.Segment] = []
        writes: list[torch.Tensor] = []
        rows: list[int] = []
        sampled_by: list[str] = []
        # A scored prompt's positions in this step (each row predicts the next prompt token).
        scored: list[tuple[int, str, int]] = []  # (row, id, position)
        spans = [(c.id, c.start, c.length, c.last) for c in plan.prefill]
        for id in plan.decode:
            known = len(self._sequences[id].tokens)
            spans.append((id, known - 1, 1, True))
        for id, start, length, last in spans:
            sequence = self._sequences[id]
            slots = self.pool.slots(self._table(sequence), start + length)
            segments.append(paged.Segment(len(ids), length, start, slots))
            writes.append(slots[start:])
            ids.extend(sequence.tokens[start : start + length])
            positions.extend(range(start, start + length))
            if last:
                rows.append(len(ids) - 1)
                sampled_by.append(id)
            if sequence.job.prompt_logprobs is not None:
                first_row = len(ids) - length
                end = min(start + length, len(sequence.job.prompt_ids) - 1)
                scored += [(first_row + p - start, id, p) for p in range(start, end)]
        decodes = None
        if self.batched_decode and len(plan.decode) > 1:
            first = len(segments) - len(plan.decode)
            decodes = paged.Decodes.of(
                segments[first].offset, [segment.slots for segment in segments[first:]]
            )
        layout = paged.StepLayout(self.pool, tuple(segments), torch.cat(writes), decodes)
        # A scored prompt's rows are taken from the model's final hidden states (what its
        # head turns into logits), kept by a hook for this step only.
        hidden: list[torch.Tensor] = []
        hook = (
            self.model.base_model.register_forward_hook(
                lambda _module, _args, output: hidden.append(output[0][0])
            )
            if scored
            else None
        )
        try:
            with torch.inference_mode():
                logits = self.model(
                    input_ids=torch.tensor([ids], device=self.device),
                    position_ids=torch.tensor([positions], device=self.device),
                    use_cache=False,
                    logits_to_keep=torch.tensor(rows, dtype=torch.long, device=self.device),
                    **{paged.STEP_KWARG: layout},
                ).logits[0]
        finally:
            if hook is not None:
                hook.remove()
        if scored:
            self._score_prompts(hidden[0], scored)
        # Every token is chosen before any is kept: a sampler that raises (logits
        # gone NaN) leaves every sequence as it was, for the step to be run again.
        # The greedy rows in one argmax and one copy to the host (on a GPU one wait for
        # the device a step, where a row at a time waited once a sequence).
        samplers = [self._sequences[id].sampler for id in sampled_by]
        plain = [row for row, sampler in enumerate(samplers) if _plain_greedy(sampler.params)]
        chosen: list[int] = [0] * len(sampled_by)
        if plain:
            picked = logits[plain].argmax(dim=-1).tolist()
            for row, token in zip(plain, picked, strict=True):
                chosen[row] = token
        for row, (id, sampler) in enumerate(zip(sampled_by, samplers, strict=True)):
            if not _plain_greedy(sampler.params):
                generated = self._sequences[id].generated
                chosen[row] = sampler.choose(logits[row], len(generated), generated)
        sampled: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        emitted: dict[str, Emitted] = {}
        for row, id in enumerate(sampled_by):
            shown = self._sequences[id].shown
            if shown is not None:  # the token a client was shown stands (see GenerationInput)
                chosen[row] = shown
        asked = {
            row: wanted
            for row, id in enumerate(sampled_by)
            if (wanted := self._sequences[id].job.logprobs) is not None
        }
        found = token_logprobs(logits, asked, chosen)
        for row, (id, token) in enumerate(zip(sampled_by, chosen, strict=True)):
            sequence = self._sequences[id]
            sequence.shown = None
            logprob = found.get(row)
            if sequence.logprobs is not None and logprob is not None:
                sequence.logprobs.append(logprob)
            sampled[id] = token
            sequence.tokens.append(token)
            sequence.generated.append(token)
            text = "" if token in self.eos_ids else sequence.detok.push(token)
            reason = self._finished(sequence, token)
            if reason is not None:
                finished[id] = reason
                # What was held back (half a character, a possible stop string's start).
                text += sequence.detok.finish()
            emitted[id] = Emitted(token, text, logprob)
        return StepResult(
            StepOutput(sampled, finished, step_s=time.perf_counter() - started), emitted
        )

    def _score_prompts(self, hidden: torch.Tensor, scored: list[tuple[int, str, int]]) -> None:
        """Each scored position's entry: the next prompt token's log probability there,
        from ``hidden`` (the step's final hidden states), :data:`SCORE_ROWS` at a time."""
        head = self.model.get_output_embeddings()
        for start in range(0, len(scored), SCORE_ROWS):
            part = scored[start : start + SCORE_ROWS]
            rows = torch.tensor([row for row, _, _ in part], device=hidden.device)
            with torch.inference_mode():
                logits = head(hidden[rows])
            asked: dict[int, int] = {}
            chosen: list[int] = []
            for i, (_, id, position) in enumerate(part):
                job = self._sequences[id].job
                asked[i] = job.prompt_logprobs or 0
                chosen.append(job.prompt_ids[position + 1])
            found = token_logprobs(logits, asked, chosen)
            for i, (_, id, position) in enumerate(part):
                self._sequences[id].prompt_logprobs[position] = found[i]

    def _finished(self, sequence: _Sequence, token: int) -> FinishReason | None:
        if token in self.eos_ids or sequence.detok.stopped:
            return FinishReason.STOP
        if len(sequence.generated) >= sequence.job.max_tokens:
            return FinishReason.LENGTH
        return None

    def _table(self, sequence: _Sequence) -> torch.Tensor:
        if sequence.table_tensor is None:
            sequence.table_tensor = torch.tensor(sequence.table, device=self.device)
        return sequence.table_tensor
