"""The generation benchmark's pure parts: the workload it draws and the figures it reports.

No torch, no clock: the requests are drawn from a seeded generator over a
token list the caller tokenized, and the figures are computed from what each
request's run recorded (arrival, first token, last token, tokens), so a unit
test checks both as tables.

* **Prompts and outputs** are clipped lognormals (most short, a long tail):
  a prompt is a window of the corpus's tokens of the drawn length, its output
  length is its ``max_tokens``, generated in full (end-of-sequence is ignored
  by all three ways of running it, so every request produces exactly that).
* **Arrivals**: all at 0 (an offline batch), or an open-loop Poisson process.
* **Static batches**: requests grouped in arrival order, ``size`` a batch.
* **Figures**: output tokens/s over the run's span (first arrival to last
  token), time to first token (arrival to first token) and time per output
  token (first to last token over the tokens after the first), p50 and p99.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.quantiles import median_range, quantile


@dataclass(frozen=True)
class Lengths:
    """A clipped lognormal of token counts: ``median``, ``sigma`` of the log, ``[low, high]``."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        drawn = rng.lognormvariate(math.log(self.median), self.sigma)
        return int(min(self.high, max(self.low, round(drawn))))


# Most prompts a few dozen tokens, about one in twelve past 256, a few near 1,000;
# most outputs about 20 tokens, about one in thirty past 128, rarely 512.
PROMPTS = Lengths(median=48.0, sigma=1.2, low=4, high=1000)
OUTPUTS = Lengths(median=20.0, sigma=1.0, low=4, high=512)


@dataclass(frozen=True)
class Request:
    """One generation request: its prompt, the tokens it generates, when it arrives."""

    id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0


def draw_workload(
    corpus_ids: Sequence[int],
    count: int,
    seed: int,
    prompts: Lengths = PROMPTS,
    outputs: Lengths = OUTPUTS,
) -> list[Request]:
    """``count`` requests, all arriving at 0: prompts are windows of ``corpus_ids``."""
    if len(corpus_ids) <= prompts.high:
        raise ValueError(f"the corpus has {len(corpus_ids)} tokens; prompts need {prompts.high}+")
    rng = random.Random(seed)
    drawn = []
    for number in range(count):
        length = prompts.draw(rng)
        start = rng.randrange(len(corpus_ids) - length)
        window = tuple(corpus_ids[start : start + length])
        drawn.append(Request(f"r{number}", window, outputs.draw(rng)))
    return drawn


def poisson_arrivals(count: int, rate_per_s: float, seed: int) -> list[float]:
    """``count`` arrival times of an open-loop Poisson process, the first at 0."""
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be positive")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate_per_s)
    return times


def arriving(requests: Sequence[Request], arrivals: Sequence[float]) -> list[Request]:
    """The requests with these arrival times, in order."""
    return [replace(r, arrival_s=t) for r, t in zip(requests, arrivals, strict=True)]


def static_batches(requests: Sequence[Request], size: int) -> list[list[Request]]:
    """Groups of ``size`` in arrival order (the last one may be smaller)."""
    if size < 1:
        raise ValueError("size must be at least 1")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


@dataclass(frozen=True)
class Record:
    """What one request's run recorded, in seconds on one clock."""

    arrival_s: float
    first_s: float
    last_s: float
    tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """The mean time per output token after the first (None for a single token)."""
        if self.tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.tokens - 1)


def summary(records: Sequence[Record]) -> dict[str, float]:
    """A run's figures: output tokens/s over its span, TTFT and TPOT p50/p99 in ms."""
    if not records:
        raise ValueError("no records")
    span_s = max(r.last_s for r in records) - min(r.arrival_s for r in records)
    tokens = sum(r.tokens for r in records)
    ttft = [r.ttft_s * 1000.0 for r in records]
    tpot = [t * 1000.0 for r in records if (t := r.tpot_s) is not None]
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "span_s": round(span_s, 3),
        "tokens_per_s": round(tokens / span_s, 2) if span_s > 0 else float("nan"),
        "ttft_p50_ms": round(quantile(ttft, 0.5), 2),
        "ttft_p99_ms": round(quantile(ttft, 0.99), 2),
        "tpot_p50_ms": round(quantile(tpot, 0.5), 2),
        "tpot_p99_ms": round(quantile(tpot, 0.99), 2),
    }


def gaps_ms(times_s: Sequence[float]) -> list[float]:
    """The intervals between consecutive token times, in ms (a stall shows as one long gap)."""
    return [(b - a) * 1000.0 for a, b in itertools.pairwise(times_s)]


def ratio_spread(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """Round by round ``ours / theirs`` (each pair ran side by side): median and range."""
    return median_range([a / b for a, b in zip(ours, theirs, strict=True) if b > 0])


def lengths_summary(values: Sequence[int]) -> dict[str, Any]:
    """How a drawn length is spread: median, p90, p99, max, mean, total."""
    return {
        "p50": round(quantile(values, 0.5), 1),
        "p90": round(quantile(values, 0.9), 1),
        "p99": round(quantile(values, 0.99), 1),
        "max": max(values),
        "mean": round(statistics.fmean(values), 1),
        "total": sum(values),
    }


def _windows(corpus_ids: Sequence[int], seed: int) -> Callable[[int], tuple[int, ...]]:
    """Draws of ``length`` consecutive tokens of the corpus, seeded."""
    rng = random.Random(seed)

    def window(length: int) -> tuple[int, ...]:
        start = rng.randrange(len(corpus_ids) - length)
        return tuple(corpus_ids[start : start + length])

    return window


@dataclass(frozen=True)
class ChunkedLoad:
    """Long prompts arriving while short ones decode (the chunked-prefill comparison).

    ``decoders`` requests of ``decoder_prompt`` prompt tokens generating
    ``decoder_tokens`` arrive at 0; then ``long_prompts`` prompts of
    ``long_prompt`` tokens, generating ``long_tokens``, one every ``every_s``
    from ``every_s`` on.
    """

    decoders: int = 16
    decoder_prompt: int = 32
    decoder_tokens: int = 160
    long_prompts: int = 6
    long_prompt: int = 900
    long_tokens: int = 8
    every_s: float = 0.5

    def draw(self, corpus_ids: Sequence[int], seed: int) -> list[Request]:
        window = _windows(corpus_ids, seed)
        drawn = [
            Request(f"d{i}", window(self.decoder_prompt), self.decoder_tokens)
            for i in range(self.decoders)
        ]
        drawn += [
            Request(f"l{i}", window(self.long_prompt), self.long_tokens, (i + 1) * self.every_s)
            for i in range(self.long_prompts)
        ]
        return drawn


@dataclass(frozen=True)
class PrefixLoad:
    """Chat-like requests that begin with one of a few long system prompts (the prefix
    caching comparison).

    ``requests`` requests, one every ``every_s`` from 0, each one of
    ``systems`` system prompts of ``system_tokens`` tokens (in turn), then a question of
    ``question_tokens`` tokens of its own, generating ``output_tokens``.
    """

    systems: int = 2
    system_tokens: int = 400
    requests: int = 32
    question_tokens: int = 24
    output_tokens: int = 24
    every_s: float = 0.1

    def draw(self, corpus_ids: Sequence[int], seed: int) -> list[Request]:
        window = _windows(corpus_ids, seed)
        systems = [window(self.system_tokens) for _ in range(self.systems)]
        return [
            Request(
                f"p{i}",
                systems[i % self.systems] + window(self.question_tokens),
                self.output_tokens,
                i * self.every_s,
            )
            for i in range(self.requests)
        ]


def decoders_figures(
    token_times_s: dict[str, list[float]], records: dict[str, Record]
) -> dict[str, float]:
    """The decoders' (ids ``d...``) TPOT p99 and token gaps, the long prompts' TTFT p50."""
    gaps = [g for id, t in token_times_s.items() if id.startswith("d") for g in gaps_ms(t)]
    tpot = [
        t * 1000.0
        for id, r in records.items()
        if id.startswith("d") and (t := r.tpot_s) is not None
    ]
    ttft = [r.ttft_s * 1000.0 for id, r in records.items() if id.startswith("l")]
    return {
        "decode_tpot_p99_ms": round(quantile(tpot, 0.99), 2),
        "decode_gap_p50_ms": round(quantile(gaps, 0.5), 2),
        "decode_gap_p99_ms": round(quantile(gaps, 0.99), 2),
        "decode_gap_max_ms": round(max(gaps), 2) if gaps else float("nan"),
        "long_ttft_p50_ms": round(quantile(ttft, 0.5), 2),
    }


def add_shared_options(parser: argparse.ArgumentParser) -> None:
    """The options both generation benchmarks take: the rounds, the workload, the model's
    shape (a llama-shaped folder, ferry.lm_build) and Ferry's limits."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--step-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk-tokens", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and load, once")


def workload_facts(
    requests: Sequence[Request], prompts: Lengths, outputs: Lengths
) -> dict[str, Any]:
    """What a generation benchmark's results file says of its workload: the distributions
    drawn from and what was drawn."""
    return {
        "prompt_lengths": asdict(prompts),
        "output_lengths": asdict(outputs),
        "prompt_tokens": lengths_summary([len(r.prompt_ids) for r in requests]),
        "output_tokens": lengths_summary([r.max_tokens for r in requests]),
    }


# --- what the generation benchmarks' results files say of their workload and runs ----------


@dataclass(frozen=True)
class TokenCounts:
    """How the drawn lengths of a workload are spread (lengths_summary writes it)."""

    p50: float
    p90: float
    p99: float
    max: int
    mean: float
    total: int


@dataclass(frozen=True)
class Workload:
    """The lengths a workload was drawn from and what was drawn."""

    prompt_lengths: Lengths
    output_lengths: Lengths
    prompt_tokens: TokenCounts
    output_tokens: TokenCounts
    chunked: ChunkedLoad | None = None  # the chunked-prefill comparison's load, if it ran
    prefix: PrefixLoad | None = None  # the prefix caching comparison's load, if it ran


@dataclass(frozen=True)
class RunFigures:
    """One run's figures (summary writes them; the engine's runs add their peak KV)."""

    requests: int
    output_tokens: int
    span_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    # The engine's runs (Ferry's): its KV pool's peak and size, its steps.
    peak_kv_blocks: int | None = None
    kv_blocks: int | None = None
    steps: int | None = None
    step_ms_mean: float | None = None
    cpu_share: float | None = None  # of a core, over the run (bench/generation.py's runs)
    # The tokens its steps computed, and the prompt tokens found in the cache instead.
    computed_tokens: int | None = None
    cached_tokens: int | None = None
    computed_per_request: float | None = None  # prompt tokens (the prefix caching runs)
