"""Choosing each sequence's next token: greedy, or sampled with temperature and top-p.

Every sampled sequence has a generator of its own, seeded from its job's
``seed``, so the same job gives the same tokens whatever else shares its
steps: the draw depends on its own logits and its own generator only.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_p`` keeps the smallest set of tokens whose
    probability reaches it; ``seed`` None draws one (reported back with the job)."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One sequence's draws."""

    def __init__(self, params: SamplingParams, device: str) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator: torch.Generator | None = None
        self._device = device

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits (``vocab``,)."""
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        if self._generator is None:
            self._generator = torch.Generator(device=self._device)
            self._generator.manual_seed(self.seed)
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            probs = top_p_filter(probs, self.params.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator).item())


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with everything outside the nucleus zeroed (the most likely token always stays)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
