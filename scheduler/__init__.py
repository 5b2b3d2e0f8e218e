"""Ferry's batching: pure functions of (pending items, profile, now), the Batcher, and the
step-level GenerationScheduler of text generation.

Nothing here reads a clock, sleeps, or touches Redis or torch.
"""

from scheduler.batcher import Batcher, policy_for
from scheduler.generation import (
    Chunk,
    GenerationLimits,
    GenerationRequest,
    GenerationScheduler,
    StepOutput,
    StepPlan,
)
from scheduler.policy import BatchDecision, PendingItem, Profile, decide
from scheduler.vocabulary import LANES, FinishReason, Lane, PolicyKind, Trigger

__all__ = [
    "LANES",
    "BatchDecision",
    "Batcher",
    "Chunk",
    "FinishReason",
    "GenerationLimits",
    "GenerationRequest",
    "GenerationScheduler",
    "Lane",
    "PendingItem",
    "PolicyKind",
    "Profile",
    "StepOutput",
    "StepPlan",
    "Trigger",
    "decide",
    "policy_for",
]
