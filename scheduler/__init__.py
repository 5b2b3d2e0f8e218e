"""Ferry's batching: pure functions of (pending items, profile, now), and the Batcher.

Nothing here reads a clock, sleeps, or touches Redis or torch.
"""

from scheduler.batcher import Batcher, policy_for
from scheduler.policy import BatchDecision, PendingItem, Profile, decide
from scheduler.vocabulary import LANES, Lane, PolicyKind, Trigger

__all__ = [
    "LANES",
    "BatchDecision",
    "Batcher",
    "Lane",
    "PendingItem",
    "PolicyKind",
    "Profile",
    "Trigger",
    "decide",
    "policy_for",
]
