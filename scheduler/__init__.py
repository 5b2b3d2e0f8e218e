"""Ferry's batching policy: pure functions of (pending items, profile, now).

Nothing here reads a clock, sleeps, or touches Redis or torch.
"""

from scheduler.policy import BatchDecision, PendingItem, Profile, decide

__all__ = ["BatchDecision", "PendingItem", "Profile", "decide"]
