"""What the generation scheduler and its runtime say to each other, field by field.

Every step the worker's loop asks the scheduler for a :class:`StepPlan`
(``schedule(now)``), has the runtime execute it, and reports what happened in
a :class:`StepOutput` (``update_from_output(plan, output, now)``). The
scheduler decides; the runtime only executes, so every field here says what
the runtime must do with it.

Token positions: a sequence's *known tokens* are its prompt followed by what
it has generated so far. The runtime holds the KV of a prefix of them; a
:class:`Chunk` asks it to compute the KV of the next run of known tokens, and
a decode computes the KV of the one known token that has none yet (the one
sampled last) and samples the next.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.vocabulary import FinishReason, Lane

__all__ = [
    "Chunk",
    "FinishReason",
    "GenerationLimits",
    "GenerationRequest",
    "StepOutput",
    "StepPlan",
]


@dataclass
class GenerationRequest:
    """One generation job, as the worker adds it.

    ``id``: the worker's handle for the job; every plan names sequences by it.
    ``prompt_tokens``: tokens of the prompt (at least 1).
    ``max_tokens``: the most tokens to generate (at least 1); the KV pool
    reserves room for all of them at admission.
    ``lane``: its priority (urgent, vip, normal, bulk).
    ``tenant``: whose job it is (the API key): tenants of one lane take turns.
    ``deadline``: absolute, on the caller's clock: when the whole job must
    have ended (None: no deadline). A request still waiting that cannot start
    before it expires; one running when it passes ends ``expired``, with the
    tokens it generated.
    ``arrival``: when the job was accepted, on the same clock (ties within a
    lane and a tenant's turn go to the earliest deadline, then to arrival).
    ``generated``: tokens it generated before, elsewhere (taken over after its
    worker died): they are prefilled with the prompt, and count towards
    ``max_tokens``.
    ``weight``: its tenant's share of the engine against other tenants' (the
    key's weight, default 1): while another tenant waits, a tenant holds at
    most its weight's share of the KV blocks and of the running slots.
    ``prefix``: the hashes of its prompt's full blocks
    (:func:`~scheduler.generation_state.prefix_hashes`): blocks whose KV holds
    the same prefix are shared, not computed again (prefix caching); empty:
    none is.
    """

    id: str
    prompt_tokens: int
    max_tokens: int
    lane: Lane = Lane.NORMAL
    tenant: str = ""
    deadline: float | None = None
    arrival: float = 0.0
    generated: int = 0
    weight: float = 1.0
    prefix: tuple[int, ...] = ()

    @property
    def total_tokens(self) -> int:
        """The most known tokens it can ever have: prompt plus max_tokens."""
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class GenerationLimits:
    """What one model instance can hold and compute per step.

    ``kv_blocks``: blocks in the KV pool (the runtime measures the bytes of a
    block at load and divides its memory budget by them); block ids are
    ``0 .. kv_blocks - 1``.
    ``block_size``: tokens of KV per block.
    ``max_running``: the most sequences in the running batch (it cannot
    exceed ``step_tokens``: every running sequence may decode a token a step).
    ``step_tokens``: the token budget of one step, prefill chunk tokens plus
    one per decoding sequence.
    ``prefill_chunk_tokens``: the most prompt tokens one sequence prefills in
    one step, so a long prompt does not stall the running decodes; 0: whole
    prompts only (each must fit one step's leftover budget).
    """

    kv_blocks: int
    block_size: int = 16
    max_running: int = 256
    step_tokens: int = 2048
    prefill_chunk_tokens: int = 512

    def __post_init__(self) -> None:
        if self.kv_blocks < 1 or self.block_size < 1:
            raise ValueError("kv_blocks and block_size must be at least 1")
        if self.max_running < 1 or self.step_tokens < 1:
            raise ValueError("max_running and step_tokens must be at least 1")
        if self.max_running > self.step_tokens:
            raise ValueError(
                f"max_running ({self.max_running}) must not exceed step_tokens "
                f"({self.step_tokens}): every running sequence decodes one token a step"
            )
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must not be negative (0: whole prompts)")

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold the KV of ``tokens`` tokens."""
        return math.ceil(tokens / self.block_size)

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the whole pool holds."""
        return self.kv_blocks * self.block_size

    def refusal(self, request: GenerationRequest) -> str | None:
        """Why ``request`` could never run within these limits (None: it can).

        Malformed (no prompt, or nothing to generate); its prompt and
        max_tokens need more KV blocks than the whole pool; or, with whole
        prompts only, its prompt is longer than a step's budget.
        """
        if request.prompt_tokens < 1 or request.max_tokens < 1:
            return "prompt_tokens and max_tokens must be at least 1"
        if not 0 <= request.generated < request.max_tokens:
            return "generated must be at least 0 and less than max_tokens"
        if not (request.weight > 0 and math.isfinite(request.weight)):
            return "weight must be a positive number"
        need = self.blocks_for(request.total_tokens)
        if need > self.kv_blocks:
            return (
                f"prompt_tokens + max_tokens = {request.total_tokens} need {need} KV blocks "
                f"of {self.block_size} tokens; the pool has {self.kv_blocks}"
            )
        if self.prefill_chunk_tokens == 0 and request.prompt_tokens > self.step_tokens:
            return (
                f"prompt_tokens = {request.prompt_tokens} exceeds step_tokens = "
                f"{self.step_tokens}, and prompts are prefilled whole (prefill_chunk_tokens = 0)"
            )
        return None


@dataclass(frozen=True)
class Chunk:
    """Compute the KV of tokens ``[start, start + length)`` of a sequence's known tokens.

    ``id``: the sequence. ``start``: the first token of the chunk (every token
    before it already has its KV on the device). ``length``: tokens in the
    chunk (at least 1). ``last``: the chunk reaches the end of the sequence's
    known tokens: the runtime samples a token from its final position (the
    sequence's first token, or the next one after a preemption).
    """

    id: str
    start: int
    length: int
    last: bool

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class StepPlan:
    """What the runtime does in one step, in this order.

    1. ``released`` and ``preempted``: free their KV blocks first (the blocks
       may be given to another sequence in this same step).
    2. ``blocks``: append the block ids to each named sequence's block table
       (a resumed sequence starts a new table: its old one was freed when it
       was preempted).
    3. ``prefill`` then ``decode``: compute, in one forward pass.

    ``prefill``: chunks to compute, in the order to execute.
    ``decode``: running sequences decoding one token this step (their prefill
    is done).
    ``admitted``: sequences taken from waiting for the first time this step:
    the worker claims these jobs. Each request is admitted at most once.
    ``blocks``: block ids newly given to a sequence this step, appended to its
    table. The scheduler gives a sequence every block it can ever need when it
    is admitted or resumed, and nothing later.
    ``preempted``: running sequences evicted this step so that an urgent one
    fits: the runtime frees their KV and keeps their tokens; they wait again
    and, once resumed, prefill prompt + what they generated.
    ``released``: sequences gone for good that the runtime holds (their KV, or
    the tokens of one preempted): cancelled, or ended by the scheduler at
    their max_tokens. The runtime frees them. Their reasons are in ``ended``.
    ``expired``: waiting requests whose deadline cannot be met; they never
    reach the device (the worker records them expired).
    ``wait_s``: only when the plan computes nothing: how long the loop may
    sleep before scheduling again (until the nearest deadline of a waiting
    request); None: until something is added or cancelled.
    ``resumed``: preempted sequences taken from waiting again this step (not
    new jobs: the worker claims nothing); each prefills all its known tokens.
    ``ended``: every request the scheduler ended since the last plan, with the
    reason: ``cancelled`` (whatever its state when ``cancel`` was called) or
    ``length`` (it reached its max_tokens and the runtime did not say it
    finished). Endings the runtime reports (``StepOutput.finished``) and
    expiries (``expired``) are not repeated here, so the three together name
    every request's end exactly once.
    ``predicted_s``: how long the step is predicted to take (the learned fit
    of its tokens; 0 for a plan that computes nothing).
    ``cached``: for each sequence admitted or resumed this step whose prompt
    began with blocks already in the pool, the tokens those blocks hold: its
    first chunk starts after them (the table's first blocks are shared, and
    the runtime only reads them).
    """

    prefill: tuple[Chunk, ...] = ()
    decode: tuple[str, ...] = ()
    admitted: tuple[str, ...] = ()
    blocks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    preempted: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    expired: tuple[str, ...] = ()
    wait_s: float | None = None
    resumed: tuple[str, ...] = ()
    ended: Mapping[str, FinishReason] = field(default_factory=dict)
    predicted_s: float = 0.0
    cached: Mapping[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Tokens computed this step: every chunk's length plus one per decode."""
        return sum(chunk.length for chunk in self.prefill) + len(self.decode)

    @property
    def empty(self) -> bool:
        """Nothing to compute (the other fields may still need applying)."""
        return not self.prefill and not self.decode

    @property
    def sampling(self) -> tuple[str, ...]:
        """The sequences that produce a token this step: each decode and each last chunk."""
        return tuple(chunk.id for chunk in self.prefill if chunk.last) + self.decode


@dataclass(frozen=True)
class StepOutput:
    """What the runtime reports after executing a plan.

    ``sampled``: one token id per sequence that produced a token this step
    (each of the plan's ``sampling``), unless it ``finished`` without one.
    ``finished``: sequences that ended this step (a stop token or string:
    ``stop``; their max_tokens: ``length``); they leave the running batch and
    their blocks return to the pool at once. A finished sequence's last
    sampled token, if any, is in ``sampled`` too.
    ``step_s``: the measured time of the step (taught to the step-time fit).
    """

    sampled: Mapping[str, int] = field(default_factory=dict)
    finished: Mapping[str, FinishReason] = field(default_factory=dict)
    step_s: float = 0.0

    def check(self, plan: StepPlan) -> None:
        """ValueError unless this answers ``plan``: a token or an ending for each sequence
        that samples in it, and for no other."""
        sampling = set(plan.sampling)
        unexpected = (set(self.sampled) | set(self.finished)) - sampling
        if unexpected:
            raise ValueError(f"output for sequences that did not sample: {sorted(unexpected)}")
        silent = sampling - set(self.sampled) - set(self.finished)
        if silent:
            raise ValueError(f"no token and no ending for {sorted(silent)}")
