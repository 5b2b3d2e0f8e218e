"""Continuous batching for text generation: what every decode step computes.

Sequences join the running batch at any step and leave it the step they
finish, as in vLLM's v1 scheduler and TGI. The worker's loop calls, every
step, ``plan = scheduler.schedule(now)``, has the runtime execute the
:class:`StepPlan`, then ``scheduler.update_from_output(plan, output, now)``;
besides those only :meth:`GenerationScheduler.add` and
:meth:`~GenerationScheduler.cancel` report to it. It reads no clock: every
time is an argument, so each rule is a table of cases.

The rules of a step, in the order :meth:`GenerationScheduler.schedule`
applies them:

1. Running sequences cancelled since the last step are released (their
   blocks are free for this very step), and so are those whose deadline has
   passed (a deadline bounds the whole job: they end ``expired``, with the
   tokens they generated; so does a preempted one waiting past it).
2. Waiting requests whose deadline has passed expire.
3. Token budget: every running sequence that has finished its prefill
   decodes one token; that comes first, so prefills never starve decodes.
   What is left of ``step_tokens`` goes to prefill chunks: urgent sequences
   still prefilling, then urgent admissions, then the other sequences still
   prefilling, then the other admissions. A chunk holds at most
   ``prefill_chunk_tokens`` (0: a whole prompt, which must fit what is left).
   The step's tokens are shared by weight too: while another tenant has a
   request waiting in its lane or a higher one, a tenant's continuing
   prefills take at most its share of what is left for prefills (see rule 4
   for shares), so a flood of long prompts cannot crowd the others'
   admissions out of a step; what the admissions leave is lent back to the
   prefills held back, before the requests passed over in rule 4.
4. Admission in waiting order (:meth:`~scheduler.generation_queue.WaitingQueue.order`:
   lane, preempted first, tenants in turn, deadline, arrival), each one only
   when a running slot, its chunk and *every block it can ever need*
   (``ceil((prompt + max_tokens) / block_size)``) are free, so no running
   sequence ever runs out of KV. The first that does not fit stops admission
   (nothing overtakes it), except that an urgent request that does not fit
   preempts running sequences of strictly lower lanes (lowest lane first,
   most recently admitted first) until it fits, when preempting them could
   make it fit. Non-urgent lanes never preempt for their lane's sake.
   Tenants share the engine by weight (each request's ``weight``, its key's):
   while another tenant has a request waiting in the same or a higher lane,
   a tenant is not admitted past its share (the pool's blocks and the
   running slots times its weight over the weights of the tenants running
   or waiting), unless it runs nothing (each may always run one) or the
   request is urgent (it starts at the next step, whoever's it is). Such a
   request is passed over, not a stop: the others' requests behind it are
   admitted. What a tenant leaves idle is lent: one alone takes everything,
   and once every request within its share is admitted, those passed over
   are admitted in the same order with what is left.
   A request within its tenant's share that does not fit takes the loan
   back: it preempts running sequences of tenants over their share (of its
   lane or lower ones, the lowest lane first, the most recently admitted
   first, never a tenant's last one), as long as they stay over it, when
   that can make it fit.
5. A waiting request not admitted whose deadline comes before this step is
   predicted to end expires: its first step could not start in time.

A sequence that was in a step the runtime failed (:meth:`GenerationScheduler.abort`)
runs *alone* until it samples its next token: it is admitted only onto an
empty running batch, and nothing is admitted beside it meanwhile, so that a
step that fails again has one culprit (the encoders' isolation, for
generation); once past that computation it runs beside the others again.

A preempted sequence loses its KV but keeps what it generated: it returns to
the front of its lane, is *resumed* (not admitted again) and then prefills
its prompt and generated tokens before it decodes again.

Prefix caching: a request may name its prompt's full blocks by hash
(``GenerationRequest.prefix``). Once a step has computed such a block, the
pool registers it; a sequence admitted or resumed later whose prompt begins
with registered blocks takes them (shared, read only: it writes only past
them) and its first chunk starts after them, never past the block of its
last known token. Admission counts only the blocks it must take from the
free list. A freed block keeps its prefix until the pool hands it out again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from scheduler.generation_estimate import estimate_finish_s
from scheduler.generation_plan import (
    Chunk,
    FinishReason,
    GenerationLimits,
    GenerationRequest,
    StepOutput,
    StepPlan,
)
from scheduler.generation_queue import WaitingQueue
from scheduler.generation_state import BlockPool, SequenceState, preemption_order
from scheduler.learning import OnlineFit
from scheduler.policy import LinearFit
from scheduler.vocabulary import Lane

__all__ = [
    "STEP_PRIOR",
    "Chunk",
    "FinishReason",
    "GenerationLimits",
    "GenerationRequest",
    "GenerationScheduler",
    "Lane",
    "StepOutput",
    "StepPlan",
]

# The step time assumed before any step is measured: 15 ms plus 50 us a token
# (a 7B model on one recent GPU: a small batch's decode step in about 15 ms, a
# full 2048-token prefill step in about 0.12 s). Two observations' worth.
STEP_PRIOR = LinearFit(intercept=0.015, slope=5e-5)


@dataclass
class _Draft:
    """The step being planned."""

    budget: int
    decoders: dict[str, SequenceState]
    chunks: list[Chunk] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    moved: set[str] = field(default_factory=set)  # admitted or preempted: not moved again
    cached: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Shares:
    """A step's tenants, each with its fraction of the engine: its weight over the weights
    of the tenants running or waiting when the step is planned."""

    fraction: dict[str, float]


class GenerationScheduler:
    """One model instance's generation queue, running batch, KV pool and step-time fit.

    ``limits``: the pool and the per-step budgets. ``step_prior``: the step
    time assumed until steps are measured (seconds, over a step's tokens).
    ``forget``: the weight an older measured step keeps at each new one.
    """

    def __init__(
        self, limits: GenerationLimits, step_prior: LinearFit = STEP_PRIOR, forget: float = 0.97
    ) -> None:
        if not 0 < forget <= 1:
            raise ValueError("forget must be in (0, 1]")
        self.limits = limits
        self._pool = BlockPool(limits.kv_blocks)
        self._fit = OnlineFit(step_prior, forget, prior_span=float(limits.step_tokens))
        self._waiting = WaitingQueue()
        self._running: dict[str, SequenceState] = {}  # in admission order
        self._released: list[str] = []  # since the last plan
        self._ended: dict[str, FinishReason] = {}  # since the last plan
        self._last_admitted: dict[str, int] = {}  # tenant -> its latest admission number
        self._weights: dict[str, float] = {}  # tenant -> its weight, the latest request's
        self._shares: _Shares | None = None  # this step's, while it is planned
        self._admissions = 0
        self._pending: StepPlan | None = None  # scheduled, not yet reported

    # --- read-only views ---------------------------------------------------------

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def blocks_free(self) -> int:
        return self._pool.free

    @property
    def blocks_used(self) -> int:
        return self._pool.used

    @property
    def step_fit(self) -> LinearFit:
        """The learned step time: seconds ~ intercept + slope x the step's tokens."""
        return self._fit.fit()

    def predicted_step_s(self, tokens: int) -> float:
        return self.step_fit(tokens) if tokens > 0 else 0.0

    def state_of(self, id: str) -> Literal["waiting", "running"] | None:
        """Where a request is (None: unknown, or ended)."""
        if id in self._waiting:
            return "waiting"
        return "running" if id in self._running else None

    def owned_blocks(self) -> Mapping[str, tuple[int, ...]]:
        """The blocks each running sequence holds, as the pool records them."""
        return self._pool.owners()

    def estimate_wait_s(self, prompt_tokens: int, max_tokens: int, lane: Lane) -> float:
        """Seconds until a request of this size added to ``lane`` now would have finished
        (:func:`~scheduler.generation_estimate.estimate_finish_s`)."""
        return estimate_finish_s(
            self.limits,
            self.step_fit,
            list(self._running.values()),
            self._waiting.values(),
            self._pool.free,
            self._pending.tokens if self._pending is not None else 0,
            prompt_tokens,
            max_tokens,
            Lane(lane),
        )

    # --- what the worker reports -------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Queue ``request``; ValueError when it is malformed, known already, or could never run.

        What could never run is :meth:`GenerationLimits.refusal`'s to say; the
        API refuses such requests before they are queued, this is the last guard.
        """
        refusal = self.limits.refusal(request)
        if refusal is None and (request.id in self._waiting or request.id in self._running):
            refusal = "already queued or running"
        if refusal is not None:
            raise ValueError(f"{request.id}: {refusal}")
        self._waiting.add(SequenceState(request, Lane(request.lane), generated=request.generated))
        self._weights[request.tenant] = request.weight

    def reset(self) -> None:
        """Forget every request, waiting or running, and any plan not yet reported: the whole
        pool is free again. What it learned (the step time, the tenants' turns) stays.

        For a worker whose Redis or database failed mid-step: it reads what it
        held again, and the runtime forgets its sequences too.
        """
        self._pool = BlockPool(self.limits.kv_blocks)
        self._waiting = WaitingQueue()
        self._running = {}
        self._released, self._ended = [], {}
        self._pending = None

    def cancel(self, id: str) -> bool:
        """End a request; False if it is not queued or running (or cancelled already).

        A waiting request is dropped at once. A running one keeps its blocks
        until the next :meth:`schedule`, which releases it (a step the runtime
        is executing still reports it). Either way the next plan names it in
        ``ended`` (``cancelled``), and in ``released`` when the runtime holds
        something of it (it runs, or was preempted and keeps its tokens). A
        running one that the runtime reports finished in the step in flight
        ends as reported instead, and is not named again.
        """
        waiting = self._waiting.remove(id)
        if waiting is not None:
            if waiting.started:
                self._released.append(id)
            self._ended[id] = FinishReason.CANCELLED
            return True
        running = self._running.get(id)
        if running is None or running.cancelled:
            return False
        running.cancelled = True
        return True

    # --- deciding a step ---------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """The step to execute now (the module's rules 1 to 5)."""
        if self._pending is not None and not self._pending.empty:
            raise RuntimeError("the last plan was not reported (update_from_output) yet")
        for sequence in [s for s in self._running.values() if s.cancelled]:
            self._drop(sequence, FinishReason.CANCELLED)
        # A deadline bounds the whole job: one that passes mid-generation ends it
        # ``expired`` with what it generated, its blocks free for this very step.
        for sequence in [s for s in self._running.values() if s.deadline <= now]:
            self._drop(sequence, FinishReason.EXPIRED)
        for sequence in [s for s in self._waiting.values() if s.started and s.deadline <= now]:
            self._waiting.remove(sequence.id)  # preempted, then out of time
            self._released.append(sequence.id)
            self._ended[sequence.id] = FinishReason.EXPIRED
        expired = [s.id for s in self._waiting.due(now)]
        decoders = {s.id: s for s in self._running.values() if not s.prefilling}
        draft = _Draft(budget=self.limits.step_tokens - len(decoders), decoders=decoders)
        self._shares = self._shares_now()
        self._continue_prefills(draft, urgent=True)
        admitting = self._admit(draft, urgent=True)
        held_back = self._continue_prefills(draft, urgent=False, shared=True)
        if admitting:
            self._admit(draft, urgent=False, held_back=held_back)
        elif held_back:
            self._continue_prefills(draft, urgent=False)
        tokens = sum(chunk.length for chunk in draft.chunks) + len(draft.decoders)
        predicted_s = self.predicted_step_s(tokens)
        # Not admitted now, its first step cannot start before this one ends.
        expired += [s.id for s in self._waiting.due(now + predicted_s)]
        soonest = self._waiting.soonest_deadline()
        wait_s = max(0.0, soonest - now) if tokens == 0 and soonest < math.inf else None
        plan = StepPlan(
            prefill=tuple(draft.chunks),
            decode=tuple(draft.decoders),
            admitted=tuple(draft.admitted),
            blocks=draft.blocks,
            preempted=tuple(draft.preempted),
            released=tuple(self._released),
            expired=tuple(expired),
            wait_s=wait_s,
            resumed=tuple(draft.resumed),
            ended=self._ended,
            predicted_s=predicted_s,
            cached=draft.cached,
        )
        self._released, self._ended = [], {}
        self._pending = plan
        self._shares = None
        if len(self._last_admitted) > 2 * len(self._waiting) + 1000:
            # Forget tenants with nothing waiting: they come back as never admitted.
            waiting = self._waiting.tenants()
            self._last_admitted = {t: n for t, n in self._last_admitted.items() if t in waiting}
        if len(self._weights) > 2 * (len(self._waiting) + len(self._running)) + 1000:
            live = self._waiting.tenants() | {s.request.tenant for s in self._running.values()}
            live |= {s.request.tenant for s in self._waiting.values() if s.started}
            self._weights = {t: w for t, w in self._weights.items() if t in live}
        return plan

    def _continue_prefills(self, draft: _Draft, urgent: bool, shared: bool = False) -> bool:
        """Plan the next chunk of each running sequence still prefilling (urgent ones, or
        the others); a sequence that has a chunk already is given more of what is left.

        ``shared``: while another tenant has a request waiting in its lane or a higher
        one, a tenant's chunks take at most its share of the budget left for prefills
        (rule 3), so that a flood of long prompts cannot crowd the others' admissions out
        of the step. True when a chunk was held back by that (it is lent what is left
        once the admissions are planned)."""
        shares = self._shares
        available = draft.budget
        taken: dict[str, int] = {}  # tenant -> prefill tokens this pass, while shared
        held_back = False
        for sequence in self._running.values():
            if (
                not sequence.prefilling
                or (sequence.lane is Lane.URGENT) != urgent
                or sequence.id in draft.moved  # admitted this step: it has its chunk
            ):
                continue
            tenant = sequence.request.tenant
            if (
                shared
                and shares is not None
                and self._waiting.others_waiting(tenant, sequence.rank)
            ):
                share = max(1, int(shares.fraction.get(tenant, 1.0) * available))
                cap = max(0, share - taken.get(tenant, 0))
                whole = self._chunk_length(sequence, draft.budget) - self._planned(sequence, draft)
                made = self._chunk(sequence, draft, cap)
                taken[tenant] = taken.get(tenant, 0) + made
                held_back |= made < whole
            else:
                self._chunk(sequence, draft)
        return held_back

    def _admit(self, draft: _Draft, urgent: bool, held_back: bool = False) -> bool:
        """Admit in waiting order (urgent ones only, or the others); False once one did not
        fit, so that nothing behind it is admitted this step. Requests past their tenant's
        share are passed over (rule 4); when everything else was admitted, prefills
        ``held_back`` at their tenant's share of the step (rule 3) are lent what is left,
        then the requests passed over, in the same order."""
        passed: set[str] = set()  # tenants at their share this step
        admitted = self._walk(draft, urgent, passed)
        if held_back:
            self._continue_prefills(draft, urgent)
        if not admitted:
            return False
        return self._walk(draft, urgent, None) if passed else True

    def _walk(self, draft: _Draft, urgent: bool, passed: set[str] | None) -> bool:
        """One walk of the waiting order; ``passed`` None: shares are not looked at (lent)."""
        for sequence in self._waiting.order(self._last_admitted, passed or frozenset()):
            if (sequence.lane is Lane.URGENT) != urgent:
                if urgent:
                    return True  # the urgent lane comes first: no more urgent ones
                continue
            if passed is not None:
                if sequence.request.tenant in passed:
                    continue  # a preempted one of a tenant at its share
                if self._past_share(sequence):
                    passed.add(sequence.request.tenant)
                    continue
            if sequence.id in draft.moved:
                return False  # preempted this step: it heads its lane, and waits a step
            if (
                not self._fits(sequence, draft)
                and not (urgent and self._evict_for(sequence, draft))
                and not (passed is not None and self._reclaim_for(sequence, draft))
            ):
                return False
            self._start(sequence, draft)
        return True

    # --- tenants' shares ------------------------------------------------------------

    def _shares_now(self) -> _Shares:
        waiting = self._waiting.tenants_by_rank()
        tenants = set().union(*waiting) | {s.request.tenant for s in self._running.values()}
        total = sum(self._weights.get(t, 1.0) for t in tenants) or 1.0
        return _Shares({t: self._weights.get(t, 1.0) / total for t in tenants})

    def _held(self, tenant: str) -> tuple[int, int]:
        """The blocks and the running slots ``tenant`` holds."""
        held = [s for s in self._running.values() if s.request.tenant == tenant]
        return sum(len(s.blocks) for s in held), len(held)

    def _over(self, tenant: str, blocks: int, slots: int) -> bool:
        """Whether holding ``blocks`` and ``slots`` puts ``tenant`` past its share."""
        shares = self._shares
        fraction = shares.fraction.get(tenant, 1.0) if shares is not None else 1.0
        return (
            blocks > fraction * self.limits.kv_blocks or slots > fraction * self.limits.max_running
        )

    def _past_share(self, sequence: SequenceState) -> bool:
        """Whether admitting ``sequence`` would take its tenant past its share while another
        tenant waits in its lane or a higher one (a tenant that runs nothing may always run
        one)."""
        if sequence.lane is Lane.URGENT:
            return False  # an urgent request starts at the next step, whoever's it is
        if not self._waiting.others_waiting(sequence.request.tenant, sequence.rank):
            return False
        blocks, slots = self._held(sequence.request.tenant)
        if slots == 0:
            return False
        need = self.limits.blocks_for(sequence.request.total_tokens)
        return self._over(sequence.request.tenant, blocks + need, slots + 1)

    def _reclaim_for(self, sequence: SequenceState, draft: _Draft) -> bool:
        """Preempt running sequences of tenants past their share (of ``sequence``'s lane or
        lower ones, the lowest lane first, the most recently admitted first, never a
        tenant's last one), while they stay past it, until ``sequence`` fits; False (and
        nothing preempted) when that cannot make it fit."""
        limits = self.limits
        tenant = sequence.request.tenant
        held = {
            t: self._held(t)
            for t in {s.request.tenant for s in self._running.values()}
            if t != tenant
        }
        victims: list[SequenceState] = []
        blocks = self._pool.free  # once the victims so far are preempted
        slots = limits.max_running - len(self._running)
        budget = draft.budget
        count, prefix = limits.blocks_for(sequence.request.total_tokens), self._prefix(sequence)
        need = self._pool.needed(count, prefix)
        tokens = sequence.known if limits.prefill_chunk_tokens == 0 else 1
        for victim in preemption_order(self._running.values(), sequence.rank - 1):
            if blocks >= need and slots >= 1 and budget >= tokens:
                break
            owner = victim.request.tenant
            if owner == tenant or victim.id in draft.moved:
                continue
            if limits.prefill_chunk_tokens == 0 and victim.known > limits.step_tokens:
                continue  # with whole prompts only it could never be resumed
            owned, running = held[owner]
            if running <= 1 or not self._over(owner, owned, running):
                continue
            held[owner] = (owned - len(victim.blocks), running - 1)
            victims.append(victim)
            blocks = self._pool.free + self._pool.freed_by(victims)
            need = self._pool.needed(count, prefix, victims)
            slots += 1
            budget += 1 if victim.id in draft.decoders else 0
            budget += sum(c.length for c in draft.chunks if c.id == victim.id)
        if not victims or blocks < need or slots < 1 or budget < tokens:
            return False
        evicted = {s.id for s in victims}
        if self._kept_apart(sequence, [s for s in self._running.values() if s.id not in evicted]):
            return False
        for victim in victims:
            self._preempt(victim, draft)
        return self._fits(sequence, draft)

    def _chunk_length(self, sequence: SequenceState, budget: int) -> int:
        todo = sequence.known - sequence.computed
        if self.limits.prefill_chunk_tokens == 0:
            if sequence.generated and todo > self.limits.step_tokens:
                # Prompt and tokens of one resumed (aborted, taken over) can outgrow a
                # step: whole prompts only, but such a one goes in chunks, or never.
                return min(todo, budget)
            return todo if todo <= budget else 0
        return min(todo, self.limits.prefill_chunk_tokens, budget)

    @staticmethod
    def _planned(sequence: SequenceState, draft: _Draft) -> int:
        """Tokens of ``sequence``'s chunk planned in this step so far."""
        return next((c.length for c in draft.chunks if c.id == sequence.id), 0)

    def _chunk(self, sequence: SequenceState, draft: _Draft, cap: int | None = None) -> int:
        """Plan ``sequence``'s chunk of this step, or lengthen the one it has, taking at
        most ``cap`` more tokens of the budget (None: the budget); the tokens it took."""
        budget = draft.budget if cap is None else min(cap, draft.budget)
        index = next((i for i, c in enumerate(draft.chunks) if c.id == sequence.id), None)
        if index is None:
            length = self._chunk_length(sequence, budget)
            if length <= 0:
                return 0
            last = sequence.computed + length == sequence.known
            draft.chunks.append(Chunk(sequence.id, sequence.computed, length, last))
            draft.budget -= length
            return length
        chunk = draft.chunks[index]
        if self.limits.prefill_chunk_tokens == 0:
            return 0  # whole prompts: its chunk is whole already
        more = min(
            sequence.known - chunk.end, self.limits.prefill_chunk_tokens - chunk.length, budget
        )
        if more <= 0:
            return 0
        end = chunk.end + more
        draft.chunks[index] = Chunk(
            chunk.id, chunk.start, chunk.length + more, end == sequence.known
        )
        draft.budget -= more
        return more

    def _prefix(self, sequence: SequenceState) -> tuple[int, ...]:
        """The hashes of ``sequence``'s prefix blocks it may take from the cache: never its
        last known token's block, whose computation gives the token it samples next; and
        none for a suspect running alone (:meth:`abort`): it computes its prompt itself."""
        if sequence.alone:
            return ()
        return sequence.request.prefix[: (sequence.known - 1) // self.limits.block_size]

    def _fits(self, sequence: SequenceState, draft: _Draft) -> bool:
        need = self.limits.blocks_for(sequence.request.total_tokens)
        return (
            len(self._running) < self.limits.max_running
            and self._pool.needed(need, self._prefix(sequence)) <= self._pool.free
            and self._chunk_length(sequence, draft.budget) > 0
            and not self._kept_apart(sequence, self._running.values())
        )

    @staticmethod
    def _kept_apart(sequence: SequenceState, running: Iterable[SequenceState]) -> bool:
        """Whether ``sequence`` may not join ``running``: one of them must run alone."""
        others = [s for s in running if s.id != sequence.id]
        return bool(others) and (sequence.alone or any(s.alone for s in others))

    def _evict_for(self, sequence: SequenceState, draft: _Draft) -> bool:
        """Preempt lower lanes until ``sequence`` fits, if evicting all of them would make it
        fit; False (and nothing preempted) otherwise."""
        limits = self.limits
        victims = [
            s
            for s in preemption_order(self._running.values(), sequence.rank)
            if s.id not in draft.moved
            # With whole prompts only, a sequence whose known tokens exceed a
            # step could never be resumed.
            and (limits.prefill_chunk_tokens > 0 or s.known <= limits.step_tokens)
        ]
        evicted = {s.id for s in victims}
        if self._kept_apart(sequence, [s for s in self._running.values() if s.id not in evicted]):
            return False  # what must stay running cannot run beside it
        blocks = self._pool.free + self._pool.freed_by(victims)
        slots = limits.max_running - len(self._running) + len(victims)
        budget = draft.budget + sum(1 for s in victims if s.id in draft.decoders)
        tokens = sequence.known if limits.prefill_chunk_tokens == 0 else 1
        count = limits.blocks_for(sequence.request.total_tokens)
        need = self._pool.needed(count, self._prefix(sequence), victims)
        if blocks < need or slots < 1 or budget < tokens:
            return False
        for victim in victims:
            if self._fits(sequence, draft):
                break
            self._preempt(victim, draft)
        return True

    def _preempt(self, sequence: SequenceState, draft: _Draft) -> None:
        chunk = next((c for c in draft.chunks if c.id == sequence.id), None)
        if chunk is not None:  # a prefill already planned this step: not any more
            draft.chunks.remove(chunk)
            draft.budget += chunk.length
        self._pool.give_back(sequence.id, sequence.blocks)
        sequence.blocks = ()
        sequence.computed = sequence.registered = 0
        sequence.prefilling = True
        del self._running[sequence.id]
        self._waiting.add(sequence)
        if draft.decoders.pop(sequence.id, None) is not None:
            draft.budget += 1
        draft.preempted.append(sequence.id)
        draft.moved.add(sequence.id)

    def _start(self, sequence: SequenceState, draft: _Draft) -> None:
        self._waiting.remove(sequence.id)  # first: the queue files it by whether it started
        prefix = self._prefix(sequence)
        hits = len(self._pool.hits(prefix))
        blocks = self._pool.take(
            sequence.id, self.limits.blocks_for(sequence.request.total_tokens), prefix
        )
        sequence.blocks = blocks
        draft.blocks[sequence.id] = blocks
        if hits:
            # Their KV is there: its first chunk starts after them.
            sequence.computed = hits * self.limits.block_size
            sequence.registered = hits
            draft.cached[sequence.id] = sequence.computed
        self._admissions += 1
        sequence.admitted_at = self._admissions
        if sequence.started:
            draft.resumed.append(sequence.id)
        else:
            sequence.first_admitted = self._admissions
            self._last_admitted[sequence.request.tenant] = self._admissions
            draft.admitted.append(sequence.id)
        self._running[sequence.id] = sequence
        draft.moved.add(sequence.id)
        self._chunk(sequence, draft)

    def _drop(self, sequence: SequenceState, reason: FinishReason | None) -> None:
        """``sequence`` leaves the running batch; ``reason`` given: the scheduler ended it, and
        the next plan tells the runtime (``released``) and the worker (``ended``)."""
        self._pool.give_back(sequence.id, sequence.blocks)
        sequence.blocks = ()
        del self._running[sequence.id]
        if reason is not None:
            self._released.append(sequence.id)
            self._ended[sequence.id] = reason

    def _register(self, sequence: SequenceState) -> None:
        """Offer the pool ``sequence``'s prefix blocks whose KV is computed now."""
        prefix = sequence.request.prefix
        full = min(len(prefix), sequence.computed // self.limits.block_size)
        for index in range(sequence.registered, full):
            self._pool.register(sequence.blocks[index], prefix[index])
        sequence.registered = max(sequence.registered, full)

    # --- what the runtime reports ------------------------------------------------

    def abort(self, plan: StepPlan) -> tuple[str, ...]:
        """The runtime raised executing ``plan`` (the last :meth:`schedule`'s): nothing the
        step computed is kept.

        Each sequence it computed loses its KV (the tokens it generated before
        stay), waits again at the head of its lane, as a preempted one does,
        and runs alone from now on. One cancelled meanwhile ends ``cancelled``
        instead. Returns the sequences the step computed, in the plan's order;
        the runtime must forget their KV (:meth:`StepRunner.reset`).
        """
        if plan is not self._pending:
            raise ValueError("abort takes the plan the last schedule returned, once")
        self._pending = None
        computed = tuple(dict.fromkeys([c.id for c in plan.prefill] + list(plan.decode)))
        for id in computed:
            sequence = self._running[id]
            if sequence.cancelled:
                self._drop(sequence, FinishReason.CANCELLED)
                continue
            # Run again alone, it computes its whole prompt itself (see _prefix), and the
            # prefix blocks it held are shared no more, in case what failed was in them.
            self._pool.forget(sequence.blocks)
            self._pool.give_back(sequence.id, sequence.blocks)
            sequence.blocks = ()
            sequence.computed = sequence.registered = 0
            sequence.prefilling = True
            sequence.alone = True
            del self._running[id]
            self._waiting.add(sequence)
        return computed

    def update_from_output(self, plan: StepPlan, output: StepOutput, now: float) -> None:
        """Apply what the runtime did with ``plan`` (the one the last :meth:`schedule`
        returned, once): KV computed, tokens sampled, sequences finished, the step's time.

        ValueError, and nothing applied, when the output does not answer the
        plan: a token or an ending for a sequence that did not sample this
        step, or a sampling sequence with neither. ``now``, the step's end,
        is not needed by the rules yet (the fit learns the measured ``step_s``).
        """
        if plan is not self._pending:
            raise ValueError("update_from_output takes the plan the last schedule returned, once")
        output.check(plan)
        self._pending = None
        for chunk in plan.prefill:
            sequence = self._running[chunk.id]
            sequence.computed = chunk.end
            sequence.prefilling = not chunk.last
            self._register(sequence)
        for id in plan.decode:
            self._running[id].computed += 1
        for id in output.sampled:
            sequence = self._running[id]
            sequence.generated += 1
            # Past the computation that failed beside others, alone: it may join them again.
            sequence.alone = False
        for id in output.finished:
            self._drop(self._running[id], None)
        for id in plan.sampling:
            still = self._running.get(id)
            if still is not None and still.remaining <= 0:
                # The runtime must report length itself; a sequence it forgot
                # would otherwise decode past the blocks reserved for it.
                self._drop(still, FinishReason.LENGTH)
        if not plan.empty and math.isfinite(output.step_s) and output.step_s >= 0:
            self._fit.observe(float(plan.tokens), output.step_s)
