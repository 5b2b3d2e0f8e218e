"""How long a new generation request would take to finish, from the learned step time.

A rough figure for the API's ``estimated_wait_ms`` (and its refusal of a
deadline the queue cannot meet), not a simulation: it counts the tokens of
work ahead of the request, how many sequences of this size the KV pool runs
at once, and the step time the scheduler learned (``a + b x tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.generation_plan import GenerationLimits
from scheduler.generation_state import SequenceState
from scheduler.policy import LinearFit
from scheduler.vocabulary import RANK, Lane


def estimate_finish_s(
    limits: GenerationLimits,
    step: LinearFit,
    running: Sequence[SequenceState],
    waiting: Sequence[SequenceState],
    blocks_free: int,
    in_flight_tokens: int,
    prompt_tokens: int,
    max_tokens: int,
    lane: Lane,
) -> float:
    """Seconds until a request of this size, added to ``lane`` now, would have finished.

    The sequences ahead of it are every running one (for an urgent request
    only the urgent ones: it preempts the others) and the waiting ones of its
    lane and the lanes above. It starts once enough of them have finished to
    free its blocks and a slot (or at once if there is room), after the step
    in flight (``in_flight_tokens``). Then it prefills its prompt in chunks and
    decodes up to ``max_tokens`` beside the others, one step per token.
    """
    rank = RANK[lane]
    urgent = lane is Lane.URGENT
    blocking = [s for s in running if not urgent or s.rank <= rank]
    evictable = sum(len(s.blocks) for s in running if urgent and s.rank > rank)
    ahead = [s for s in waiting if s.rank <= rank]
    need = limits.blocks_for(prompt_tokens + max_tokens)
    ahead_blocks = [limits.blocks_for(s.request.total_tokens) for s in ahead]
    held_blocks = sum(len(s.blocks) for s in blocking) + sum(ahead_blocks)

    prefill = sum(s.to_prefill for s in blocking) + sum(s.known for s in ahead)
    decode = sum(s.remaining for s in blocking) + sum(s.remaining for s in ahead)
    count = len(blocking) + len(ahead)
    mean_blocks = (held_blocks + need) / (count + 1)
    together = max(1, min(limits.max_running, int(limits.kv_blocks // max(mean_blocks, 1.0))))

    # Draining the work ahead: each step carries at most step_tokens, and at
    # most one decode token per sequence running together.
    drain_steps = max((prefill + decode) / limits.step_tokens, decode / together)
    drain_s = drain_steps * step((prefill + decode) / drain_steps) if drain_steps > 0 else 0.0
    room_blocks = blocks_free + evictable - sum(ahead_blocks)
    room_slots = limits.max_running - count
    if room_blocks >= need and room_slots >= 1:
        share = 0.0
    else:
        # Sequences ahead finish over the drain, freeing their blocks and slots
        # about evenly: it starts once its shortfall of each has been freed.
        short_blocks = max(0, need - room_blocks) / held_blocks if held_blocks else 1.0
        short_slots = max(0, 1 - room_slots) / count if count else 1.0
        share = min(1.0, max(short_blocks, short_slots))
    in_flight_s = step(in_flight_tokens) if in_flight_tokens > 0 else 0.0
    start_s = in_flight_s + share * drain_s

    beside = min(together - 1, count)
    chunk = min(prompt_tokens, limits.prefill_chunk_tokens or prompt_tokens)
    full, rest = divmod(prompt_tokens, chunk)
    prefill_s = full * step(min(limits.step_tokens, chunk + beside))
    if rest:
        prefill_s += step(min(limits.step_tokens, rest + beside))
    decode_s = (max_tokens - 1) * step(min(limits.step_tokens, 1 + beside))
    return start_s + prefill_s + decode_s
