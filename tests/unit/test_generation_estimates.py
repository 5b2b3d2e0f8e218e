"""The first-token wait the API quotes for a generation job, and the hash it is read from."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.models.estimates import ModelEstimate
from core.models.generation_estimates import (
    GenerationEstimate,
    finish_s,
    first_token_s,
    most_tokens_within,
)

# A step costs 10 ms plus 1 ms a token; 4 sequences at most; the usual job has a
# 20-token prompt, asks for 40 tokens (4 blocks of 16) and generates 30.
BASE = GenerationEstimate(
    execution="step",
    why="",
    step_a_s=0.01,
    step_b_s=0.001,
    kv_blocks=1000,
    block_size=16,
    bytes_per_block=4096,
    max_running=4,
    step_tokens=256,
    prefill_chunk_tokens=64,
    running=0,
    waiting=0,
    mean_prompt_tokens=20.0,
    mean_max_tokens=40.0,
    mean_completion_tokens=30.0,
)


def step(tokens: float) -> float:
    return 0.01 + 0.001 * tokens


CASES = [
    # (what, estimate, ahead, prompt_tokens, max_tokens, workers, expected seconds)
    ("idle: its own prefill, in chunks of 64", BASE, 0, 100, 40, 1, step(64) + step(36)),
    (
        "room beside 3 running: the step in flight, then its prefill beside them",
        replace(BASE, running=3), 3, 20, 40, 1, step(3) + step(23),
    ),
    (
        "a burst: the 3 ahead had not started, their 60 prompt tokens go first, in its step",
        BASE, 3, 20, 40, 1, step(3) + step(80),
    ),
    (
        "a burst past a step: 10 ahead, their 200 prompt tokens and its 20 in 2.2 full steps",
        replace(BASE, max_running=64, step_tokens=100), 10, 20, 40, 1,
        step(10) + 2.2 * step(100),
    ),
    (
        "2 of the 3 ahead running: the other's prompt, then its own, beside 2 decodes",
        replace(BASE, running=2), 3, 20, 40, 1, step(3) + step(42),
    ),
    (
        "slots full: 5 of the 8 ahead end first, 4 decoding at a time, the 3 that run beside it"
        " prefilling meanwhile (37.5 steps of 310/37.5 tokens)",
        BASE, 8, 20, 40, 1, step(3) + (37.5 * 0.01 + 0.001 * 310) + step(23),
    ),
    (
        "two workers share the 8 ahead: 4 each, one must end first",
        BASE, 8, 20, 40, 2, step(3) + (7.5 * 0.01 + 0.001 * 110) + step(23),
    ),
    (
        "the KV pool holds 2 usual jobs: 2 of the 3 ahead end first, 2 decoding at a time",
        replace(BASE, kv_blocks=8), 3, 20, 40, 1, step(1) + (30 * 0.01 + 0.001 * 120) + step(21),
    ),
    (
        "nothing seen yet: those ahead are its size and run to their max_tokens (2 end first)",
        replace(BASE, mean_prompt_tokens=0, mean_max_tokens=0, mean_completion_tokens=0),
        5, 10, 50, 1, step(3) + (25 * 0.01 + 0.001 * 150) + step(13),
    ),
    (
        "long prompts, one token each: the 100-token step budget bounds the drain",
        replace(BASE, step_tokens=100, mean_prompt_tokens=100.0, mean_completion_tokens=1.0),
        8, 20, 40, 1, step(3) + (8.05 * 0.01 + 0.001 * 805) + step(23),
    ),
    (
        "generate(): 4 a batch, so 2 whole batches ahead of 9, then its own beside 1",
        replace(BASE, execution="generate", why="not natively stepped", prefill_chunk_tokens=0),
        9, 20, 40, 1, 2 * step(80) + step(40),
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("estimate", "ahead", "prompt", "max_tokens", "workers", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_first_token_s(
    estimate: GenerationEstimate,
    ahead: int,
    prompt: int,
    max_tokens: int,
    workers: int,
    expected: float,
) -> None:
    assert first_token_s(estimate, ahead, prompt, max_tokens, workers) == pytest.approx(expected)


@pytest.mark.parametrize(
    "estimate",
    [
        BASE,
        replace(BASE, running=4),
        replace(BASE, max_running=64, step_tokens=100),
        replace(BASE, max_running=64, step_tokens=100, running=30),
        replace(BASE, kv_blocks=40, prefill_chunk_tokens=0),
    ],
    ids=["base", "four-running", "wide-burst", "wide-thirty-running", "small-pool"],
)
def test_more_ahead_never_means_a_shorter_wait(estimate: GenerationEstimate) -> None:
    waits = [first_token_s(estimate, ahead, 20, 40) for ahead in range(0, 200)]
    assert waits == sorted(waits)
    assert waits[-1] > 10 * waits[3]


def test_the_hash_round_trips_and_an_encoders_hash_is_not_a_generations() -> None:
    raw = BASE.to_hash()
    assert raw["execution"] == "step" and raw["why"] == ""
    assert GenerationEstimate.from_hash(raw) == BASE
    whole = replace(BASE, execution="generate", why="gpt_neox is not stepped natively")
    assert GenerationEstimate.from_hash(whole.to_hash()) == whole
    cached = replace(BASE, prefix_caching=True)
    assert GenerationEstimate.from_hash(cached.to_hash()) == cached
    # A worker of an earlier version publishes no prefix_caching: read as off, not as none.
    older = {k: v for k, v in cached.to_hash().items() if k != "prefix_caching"}
    assert GenerationEstimate.from_hash(older) == BASE
    # Neither reads the other's fields.
    assert ModelEstimate.from_hash({k: 1.0 for k in raw if k not in ("execution", "why")}) is None
    encoder = ModelEstimate(0.01, 0.001, False, 32, float("inf"), 10.0).to_hash()
    assert GenerationEstimate.from_hash(encoder) is None
    # Half published, or an execution it does not know: nothing to estimate from.
    assert GenerationEstimate.from_hash({"execution": "step", "step_a_s": "0.01"}) is None
    assert GenerationEstimate.from_hash(raw | {"execution": "fast"}) is None
    assert GenerationEstimate.from_hash(raw | {"kv_blocks": "many"}) is None


@pytest.mark.parametrize(
    ("what", "ahead", "running", "beside"),
    [
        ("idle: it decodes alone", 0, 0, 0),
        ("3 ahead start with it: it decodes beside them", 3, 0, 3),
        ("8 ahead: 3 at most beside it (4 slots)", 8, 0, 3),
        ("nothing queued but 2 running when the worker published", 0, 2, 2),
    ],
)
def test_a_generation_ends_a_decode_step_a_token_after_its_first(
    what: str, ahead: int, running: int, beside: int
) -> None:
    est = replace(BASE, running=running)
    first = first_token_s(est, ahead, 20, 40)
    assert finish_s(est, ahead, 20, 40) == pytest.approx(first + 39 * step(beside + 1)), what
    # Through generate(), every token comes with the first, when its batch ends.
    whole = replace(est, execution="generate")
    assert finish_s(whole, ahead, 20, 40) == first_token_s(whole, ahead, 20, 40)


@pytest.mark.parametrize("deadline_s", [0.05, 0.2, 0.31, 0.5, 1.0, 10.0])
def test_the_most_tokens_within_a_deadline_are_the_last_that_end_in_time(
    deadline_s: float,
) -> None:
    fit = most_tokens_within(BASE, 3, 20, 400, deadline_s)
    first = first_token_s(BASE, 3, 20, 400)
    if first > deadline_s:
        assert fit == 0
        return
    assert 1 <= fit <= 400
    assert finish_s(BASE, 3, 20, fit) <= deadline_s + 1e-9
    if fit < 400:
        assert finish_s(BASE, 3, 20, fit + 1) > deadline_s
    assert most_tokens_within(BASE, 3, 20, 10, 10.0) == 10  # never more than asked
