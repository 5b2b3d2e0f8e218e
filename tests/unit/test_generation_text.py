"""The text side of generation: incremental detokenizing, stop strings, sampling."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from backends.generation.detok import Detokenizer
from backends.generation.sampling import (
    Sampler,
    SamplingParams,
    adjusted,
    draw_seed,
    top_p_filter,
)
from tests.lm import lm_folder

TEXTS = [
    "Ferry queues jobs on Redis Streams.",
    "naïve café, déjà vu — “quoted” text",
    "emoji 🙂🚀 and CJK 模型推理 mixed in",
    "  leading spaces and\nnew lines\n\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(lm_folder("gpt2") / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_text_and_never_hold_half_a_character(
    tokenizer: Tokenizer, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = Detokenizer(tokenizer)
    pieces = [detok.push(token) for token in ids]
    pieces.append(detok.finish())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_character_split_over_tokens_comes_out_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🚀", add_special_tokens=False).ids
    assert len(ids) > 1  # byte-level BPE spells a rare emoji in several tokens
    detok = Detokenizer(tokenizer)
    pieces = [detok.push(token) for token in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🚀"


def test_text_stops_before_the_stop_string_and_never_shows_part_of_it(
    tokenizer: Tokenizer,
) -> None:
    text = "one two three four five six"
    detok = Detokenizer(tokenizer, stop=["four"])
    shown = ""
    for token in tokenizer.encode(text, add_special_tokens=False).ids:
        shown += detok.push(token)
        assert "four" not in shown
        if detok.stopped:
            break
    shown += detok.finish()
    assert detok.stopped
    assert shown == "one two three "
    assert detok.text == "one two three "


def test_a_held_back_stop_prefix_is_released_when_the_stop_string_does_not_follow(
    tokenizer: Tokenizer,
) -> None:
    detok = Detokenizer(tokenizer, stop=["fourteen"])
    pieces = [detok.push(t) for t in tokenizer.encode("four five", add_special_tokens=False).ids]
    pieces.append(detok.finish())
    assert "".join(pieces) == "four five"
    assert not detok.stopped


def test_greedy_takes_the_most_likely_token() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert Sampler(SamplingParams(temperature=0.0), "cpu").choose(logits, 0) == 1


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others() -> None:
    logits = torch.randn(2048, generator=torch.Generator().manual_seed(3))

    def draws(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.5, top_p=0.95, seed=seed), "cpu")
        return [sampler.choose(logits, n) for n in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 1  # each position draws afresh


def test_a_draw_depends_on_its_position_not_on_the_draws_before_it() -> None:
    # A generation resumed at token k (another worker, after a crash) draws token k
    # as the uninterrupted run did, without replaying the k draws before it.
    logits = torch.randn(2048, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.2, top_p=0.9, seed=11)
    whole = Sampler(params, "cpu")
    uninterrupted = [whole.choose(logits, n) for n in range(12)]
    resumed = Sampler(params, "cpu")
    assert [resumed.choose(logits, n) for n in range(7, 12)] == uninterrupted[7:]
    assert draw_seed(11, 0) != draw_seed(11, 1) != draw_seed(12, 0)
    assert all(0 <= draw_seed(s, p) < 2**63 for s in (0, 2**63 - 1) for p in (0, 10**9))


def test_no_seed_draws_one_and_reports_it() -> None:
    first = Sampler(SamplingParams(temperature=1.0), "cpu")
    second = Sampler(SamplingParams(temperature=1.0), "cpu")
    assert first.seed != second.seed
    again = Sampler(SamplingParams(temperature=1.0, seed=first.seed), "cpu")
    logits = torch.randn(100)
    assert [first.choose(logits, n) for n in range(5)] == [
        again.choose(logits, n) for n in range(5)
    ]


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = top_p_filter(probs, 0.75)
    assert kept.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert top_p_filter(probs, 0.1).tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_sampling_never_draws_outside_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.07, 0.03]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=1), "cpu")
    assert {sampler.choose(logits, n) for n in range(200)} == {0, 1}


def test_the_bias_and_penalties_follow_openais_definition() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    params = SamplingParams(
        temperature=0.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias=((0, 10.0), (4, -100.0)),
    )
    # Token 1 came twice, token 3 once; the prompt's tokens are not passed and not counted.
    found = adjusted(logits, params, [1, 3, 1])
    assert found.tolist() == pytest.approx(
        [1.0 + 10.0, 2.0 - 0.5 - 2 * 0.25, 3.0, 4.0 - 0.5 - 0.25, 5.0 - 100.0]
    )
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # the step's logits are left as they were
    assert Sampler(params, "cpu").choose(logits, 3, [1, 3, 1]) == 0
    assert Sampler(SamplingParams(temperature=0.0), "cpu").choose(logits, 3, [1, 3, 1]) == 4


def test_a_penalty_may_be_negative_and_favour_what_came() -> None:
    logits = torch.tensor([2.0, 1.0])
    params = SamplingParams(temperature=0.0, presence_penalty=-1.5)
    sampler = Sampler(params, "cpu")
    assert sampler.choose(logits, 0, []) == 0
    assert sampler.choose(logits, 1, [1]) == 1  # 1.0 + 1.5 beats 2.0
    assert not SamplingParams().adjusts and params.adjusts


def test_sampling_draws_from_the_adjusted_distribution() -> None:
    # A bias of -100 takes a token out of reach, whatever the draw.
    logits = torch.zeros(4)
    params = SamplingParams(temperature=1.0, seed=3, logit_bias=((1, -100.0), (2, -100.0)))
    sampler = Sampler(params, "cpu")
    assert {sampler.choose(logits, n) for n in range(200)} == {0, 3}
