"""Choosing each sequence's next token: greedy, or sampled with temperature and top-p.

Before either, the logits may be adjusted as OpenAI's API defines it: a
``logit_bias`` added to the tokens it names, and for each token already
generated, ``presence_penalty`` once and ``frequency_penalty`` per time it
came (the prompt's tokens do not count).

Every sampled sequence has a generator of its own, seeded from its job's
``seed`` and the token's position, so the same job gives the same tokens
whatever else shares its steps (the draw depends on its own logits and its
own seed only), and a generation resumed from its first ``k`` tokens, on
another worker, draws token ``k`` as the uninterrupted run did: no draw
depends on how many draws came before it in this process.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_p`` keeps the smallest set of tokens whose
    probability reaches it; ``seed`` None draws one (reported back with the job).
    ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token id and the
    number added to its logit) adjust the logits first."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before the choice."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def adjusted(
    logits: torch.Tensor, params: SamplingParams, generated: Sequence[int]
) -> torch.Tensor:
    """One row of logits (``vocab``,) with the bias and the penalties applied, as float32."""
    out = logits.float().clone()
    # Past the model's vocabulary (a tokenizer with more tokens than the model's head)
    # nothing is biased: an index out of range would stop a CUDA device.
    bias = [(i, b) for i, b in params.logit_bias if i < out.numel()]
    if bias:
        ids = torch.tensor([i for i, _ in bias], device=out.device)
        out.index_add_(0, ids, torch.tensor([b for _, b in bias], device=out.device))
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = Counter(generated)
        ids = torch.tensor(list(counts), device=out.device)
        times = torch.tensor(list(counts.values()), dtype=out.dtype, device=out.device)
        out.index_add_(0, ids, -(params.presence_penalty + params.frequency_penalty * times))
    return out


# Mixes a seed and a token's position into the seed of that token's draw
# (SplitMix64's constants): nearby seeds and positions give unrelated draws.
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of the draw of token ``position`` (0-based) of a sequence."""
    z = (seed + (position + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1  # a non-negative int64, as manual_seed takes


class Sampler:
    """One sequence's draws."""

    def __init__(self, params: SamplingParams, device: str) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator: torch.Generator | None = None
        self._device = device

    def choose(self, logits: torch.Tensor, position: int, generated: Sequence[int] = ()) -> int:
        """Token ``position`` of the sequence's output (0: its first) from one row of
        logits (``vocab``,); ``generated``: the output before it, which the penalties
        count."""
        if self.params.adjusts:
            logits = adjusted(logits, self.params, generated)
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        if self._generator is None:
            self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(draw_seed(self.seed, position))
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
