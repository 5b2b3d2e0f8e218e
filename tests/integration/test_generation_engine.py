"""The generation engine on real model folders: Ferry's tokens against the library's own.

Each model is a folder ``ferry.lm_build`` wrote (random weights, a trained
tokenizer), loaded through the ``causal-lm`` backend with the library's
``from_pretrained``. Hundreds of prompts of mixed lengths arrive a few per
step, so they share steps, join and leave the running batch mid-way, and
long ones are prefilled in chunks; greedy decoding must give, for every
prompt, exactly the tokens of ``transformers``' ``generate()`` on that prompt
alone.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from backends.base import RuntimeOptions
from backends.generation import CausalLMRuntime, GenerationSettings
from backends.generation.runtime import GREEDY, Completion, GenerationInput
from backends.generation.sampling import SamplingParams
from scheduler.generation import GenerationLimits, GenerationRequest, GenerationScheduler, Lane
from scheduler.generation_state import prefix_hashes
from tests.lm import ARCHES, lm_folder
from workers.gpu.engine import GenerationEngine

PROMPTS = 200
CORPUS = Path(__file__).resolve().parents[2] / "ferry" / "data" / "lm_corpus.txt"


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    max_tokens: int


@cache
def loaded(arch: str) -> CausalLMRuntime:
    settings = GenerationSettings(max_running=24, step_tokens=256, prefill_chunk_tokens=64)
    # One thread: on a machine this busy, torch's thread pool spinning on both
    # cores costs more than it gains for a model this small.
    options = RuntimeOptions(device="cpu", cpu_threads=1)
    runtime = CausalLMRuntime(arch, lm_folder(arch), settings, options)
    runtime.load()
    return runtime


def engine(arch: str, **limits: int) -> GenerationEngine:
    runtime = loaded(arch)
    base = runtime.limits
    chosen = GenerationLimits(
        kv_blocks=limits.get("kv_blocks", base.kv_blocks),
        block_size=base.block_size,
        max_running=limits.get("max_running", base.max_running),
        step_tokens=limits.get("step_tokens", base.step_tokens),
        prefill_chunk_tokens=limits.get("prefill_chunk_tokens", base.prefill_chunk_tokens),
    )
    return GenerationEngine(GenerationScheduler(chosen), runtime.runner)


def prompts(arch: str, count: int, seed: int = 0) -> list[Prompt]:
    """Prompts from the shipped corpus: most short, some long (past one prefill chunk)."""
    rng = random.Random(seed)
    words = CORPUS.read_text(encoding="utf-8").split()
    tokenizer = loaded(arch).runner.tokenizer
    out = []
    for _ in range(count):
        length = rng.choice([1, 2, 3, 5, 8, 8, 13, 20, 20, 40, 90, 200])
        start = rng.randrange(len(words) - length)
        ids = tokenizer.encode(" ".join(words[start : start + length])).ids[:400]
        out.append(Prompt(tuple(ids), rng.choice([1, 2, 4, 8, 8, 16, 16, 24, 40])))
    return out


@cache
def library_model(arch: str) -> Any:
    """The folder loaded as a user would, with the library's own attention."""
    return AutoModelForCausalLM.from_pretrained(lm_folder(arch)).eval()


class OpenAIAdjust(LogitsProcessor):
    """OpenAI's logit_bias, presence_penalty and frequency_penalty, written from its
    definition, token by token, for the library's ``generate()``."""

    def __init__(self, params: SamplingParams, prompt_length: int) -> None:
        self.params = params
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()  # type: ignore[assignment]
        for row, ids in enumerate(input_ids.tolist()):
            generated = ids[self.prompt_length :]
            for token, bias in self.params.logit_bias:
                scores[row, token] += bias
            for token in set(generated):
                times = generated.count(token)
                scores[row, token] -= self.params.presence_penalty
                scores[row, token] -= self.params.frequency_penalty * times
        return scores


def library_generate(
    model: Any, prompt: Prompt, eos: list[int], params: SamplingParams | None, **options: Any
) -> Any:
    """The library's greedy ``generate()`` on the prompt alone (the logits adjusted by
    ``params``' bias and penalties, when given)."""
    ids = torch.tensor([prompt.ids])
    processors = LogitsProcessorList()
    if params is not None:
        processors.append(OpenAIAdjust(params, len(prompt.ids)))
    with torch.inference_mode():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=prompt.max_tokens,
            do_sample=False, eos_token_id=eos, pad_token_id=eos[0], logits_processor=processors,
            **options,
        )  # fmt: skip


def reference(arch: str, prompt: Prompt, params: SamplingParams | None = None) -> list[int]:
    """The library's greedy tokens for the prompt alone."""
    eos = list(loaded(arch).runner.eos_ids)
    out = library_generate(library_model(arch), prompt, eos, params)
    return [int(t) for t in out[0, len(prompt.ids) :]]


def run(
    engine: GenerationEngine,
    jobs: list[tuple[GenerationRequest, GenerationInput]],
    arrivals: Iterator[int],
    on_step: object = None,
) -> dict[str, Completion]:
    """Add ``jobs`` a few per step (``arrivals``: how many before each step) until all end."""
    ended: dict[str, Completion] = {}
    queue = list(jobs)
    now = 0.0
    while len(ended) < len(jobs):
        for _ in range(next(arrivals) if queue else 0):
            if queue:
                request, job = queue.pop(0)
                engine.add(request, job)
        events = engine.step(now)
        if callable(on_step):
            on_step(events)
        ended.update(events.ended)
        now += 0.01
        assert now < 10_000, "the engine stopped making progress"
    return ended


def arrivals(seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    while True:
        yield rng.choice([0, 0, 1, 1, 2, 3, 8])


def greedy(id: str, prompt: Prompt, **fields: object) -> tuple[GenerationRequest, GenerationInput]:
    request = GenerationRequest(id, len(prompt.ids), prompt.max_tokens, **fields)  # type: ignore[arg-type]
    return request, GenerationInput(prompt.ids, prompt.max_tokens)


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_tokens_equal_the_librarys_generate_on_each_prompt_alone(arch: str) -> None:
    assert loaded(arch).execution == "step"
    cases = prompts(arch, PROMPTS)
    shared_steps: list[int] = []
    eng = engine(arch)
    ended = run(
        eng,
        [greedy(str(i), p) for i, p in enumerate(cases)],
        arrivals(1),
        on_step=lambda events: shared_steps.append(len(events.plan.sampling)),
    )
    # They really shared steps, and long prompts were prefilled in chunks.
    assert max(shared_steps) >= 8
    assert any(len(p.ids) > 64 for p in cases)
    mismatched = [
        i for i, p in enumerate(cases) if list(ended[str(i)].token_ids) != reference(arch, p)
    ]
    assert mismatched == []
    for i, p in enumerate(cases):
        completion = ended[str(i)]
        assert completion.prompt_tokens == len(p.ids)
        assert 1 <= len(completion.token_ids) <= p.max_tokens
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == p.max_tokens


@pytest.mark.parametrize("arch", ARCHES)
def test_decodes_attended_in_one_padded_call_still_equal_generate(arch: str) -> None:
    """The GPU's way of attending the decodes (one call, keys padded), checked here on the CPU."""
    cases = prompts(arch, 60, seed=2)
    eng = engine(arch)
    runner = eng.runtime
    runner.batched_decode = True  # type: ignore[attr-defined]
    try:
        ended = run(eng, [greedy(str(i), p) for i, p in enumerate(cases)], arrivals(6))
    finally:
        runner.batched_decode = False  # type: ignore[attr-defined]
    mismatched = [
        i for i, p in enumerate(cases) if list(ended[str(i)].token_ids) != reference(arch, p)
    ]
    assert mismatched == []


@pytest.mark.parametrize("arch", ARCHES)
def test_a_preempted_sequence_resumes_and_still_equals_generate(arch: str) -> None:
    """Bulk work fills the KV pool; urgent jobs preempt it; every result is unchanged."""
    cases = prompts(arch, 24, seed=5)
    long = [Prompt(p.ids[:50], 40) for p in cases]
    eng = engine(arch, kv_blocks=30, max_running=8)
    jobs = [greedy(f"b{i}", p, lane=Lane.BULK) for i, p in enumerate(long[:16])]
    jobs += [greedy(f"u{i}", p, lane=Lane.URGENT) for i, p in enumerate(long[16:])]
    preempted: set[str] = set()
    ended = run(
        eng,
        jobs,
        iter([16] + [0] * 6 + [1] * 10_000),
        on_step=lambda events: preempted.update(events.plan.preempted),
    )
    assert preempted, "the urgent jobs never had to preempt: the test proves nothing"
    for (request, _), prompt in zip(jobs, long, strict=True):
        assert list(ended[request.id].token_ids) == reference(arch, prompt), request.id


def test_the_kv_pool_is_never_overcommitted_where_naive_admission_would() -> None:
    cases = prompts("llama", 60, seed=9)
    eng = engine("llama", kv_blocks=40)
    demand = sum(-(-(len(p.ids) + p.max_tokens) // 16) for p in cases)
    assert demand > 2 * 40  # admitting everyone that arrives would need far more blocks
    peak = 0

    def watch(events: object) -> None:
        nonlocal peak
        peak = max(peak, eng.scheduler.blocks_used)
        assert eng.scheduler.blocks_used <= 40

    ended = run(eng, [greedy(str(i), p) for i, p in enumerate(cases)], arrivals(2), watch)
    assert peak > 30  # the pool was used, not left idle
    assert all(ended[str(i)].token_ids for i in range(len(cases)))


def test_cancelling_a_running_job_frees_its_slot_for_a_waiting_one_at_the_next_step() -> None:
    cases = prompts("gpt2", 3, seed=3)
    eng = engine("gpt2", max_running=2)
    jobs = [greedy(str(i), Prompt(p.ids, 40)) for i, p in enumerate(cases)]
    for request, job in jobs:
        eng.add(request, job)
    now = 0.0
    for _ in range(5):
        events = eng.step(now)
        now += 0.01
    assert eng.scheduler.state_of("2") == "waiting"
    produced = len(eng.runtime.tokens("0"))  # type: ignore[attr-defined]
    assert eng.cancel("0")
    events = eng.step(now)
    assert events.ended["0"].finish_reason == "cancelled"
    assert len(events.ended["0"].token_ids) == produced
    assert "2" in events.plan.admitted


def test_sampling_with_a_seed_is_reproducible_whatever_shares_its_steps() -> None:
    cases = prompts("llama", 30, seed=11)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    target = Prompt(cases[0].ids, 24)

    def sample_alone() -> tuple[int, ...]:
        eng = engine("llama")
        request = GenerationRequest("t", len(target.ids), 24)
        ended = run(eng, [(request, GenerationInput(target.ids, 24, sampled))], iter([1] * 99))
        return ended["t"].token_ids

    alone = sample_alone()
    eng = engine("llama")
    jobs = [greedy(str(i), p) for i, p in enumerate(cases[1:])]
    jobs.insert(
        7, (GenerationRequest("t", len(target.ids), 24), GenerationInput(target.ids, 24, sampled))
    )
    ended = run(eng, jobs, arrivals(4))
    crowded = ended["t"].token_ids
    assert crowded == alone == sample_alone()
    # The greedy sequences that shared its steps (chosen together, apart from its draw)
    # still equal generate().
    mismatched = [
        i for i, p in enumerate(cases[1:]) if list(ended[str(i)].token_ids) != reference("llama", p)
    ]
    assert mismatched == []
    other = GenerationInput(target.ids, 24, SamplingParams(temperature=0.9, top_p=0.9, seed=99))
    eng = engine("llama")
    different = run(eng, [(GenerationRequest("t", len(target.ids), 24), other)], iter([1] * 99))
    assert different["t"].token_ids != alone


def adjusting(rng: random.Random, prompt: Prompt, vocab: int) -> SamplingParams:
    """Greedy, with penalties and a bias drawn for the prompt: on its own tokens (some
    pushed up, some down), and on tokens anywhere in the vocabulary."""
    biased = [*rng.sample(prompt.ids, min(2, len(prompt.ids))), *rng.sample(range(vocab), 3)]
    return SamplingParams(
        temperature=0.0,
        presence_penalty=rng.choice([0.0, 0.5, 1.5, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.3, 2.0]),
        logit_bias=tuple(sorted({t: rng.choice([-100.0, -2.0, 1.5, 5.0]) for t in biased}.items())),
    )


@pytest.mark.parametrize("arch", ARCHES)
def test_penalties_and_logit_bias_equal_generate_with_openais_definition(arch: str) -> None:
    """Adjusted greedy jobs share steps with plain ones; each equals generate() on its
    prompt alone with OpenAI's bias and penalties applied, and the plain ones are
    unchanged."""
    rng = random.Random(17)
    vocab = library_model(arch).config.vocab_size
    cases = [Prompt(p.ids[:80], max(p.max_tokens, 8)) for p in prompts(arch, 40, seed=13)]
    params = [adjusting(rng, p, vocab) if i % 4 else None for i, p in enumerate(cases)]
    jobs = []
    for i, (prompt, adjust) in enumerate(zip(cases, params, strict=True)):
        request = GenerationRequest(str(i), len(prompt.ids), prompt.max_tokens)
        jobs.append((request, GenerationInput(prompt.ids, prompt.max_tokens, adjust or GREEDY)))
    ended = run(engine(arch), jobs, arrivals(8))
    mismatched = [
        i
        for i, (prompt, adjust) in enumerate(zip(cases, params, strict=True))
        if list(ended[str(i)].token_ids) != reference(arch, prompt, adjust)
    ]
    assert mismatched == []
    changed = [
        i
        for i, (prompt, adjust) in enumerate(zip(cases, params, strict=True))
        if adjust is not None and list(ended[str(i)].token_ids) != reference(arch, prompt)
    ]
    assert len(changed) >= 10, "the adjustments changed almost nothing: the test proves little"


def test_a_resumed_job_counts_its_earlier_tokens_in_the_penalties() -> None:
    """Taken over after 6 tokens, a penalised job goes on as the uninterrupted run did:
    the tokens it made elsewhere are counted as if made here."""
    prompt = Prompt(prompts("llama", 20, seed=21)[3].ids[:30], 20)
    adjust = SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=1.5)
    whole = reference("llama", prompt, adjust)
    assert len(whole) > 8 and whole != reference("llama", prompt)
    request = GenerationRequest("r", len(prompt.ids), prompt.max_tokens, generated=6)
    job = GenerationInput(prompt.ids, prompt.max_tokens, adjust, resumed=tuple(whole[:6]))
    ended = run(engine("llama"), [(request, job)], iter([1] + [0] * 10_000))
    assert list(ended["r"].token_ids) == whole


def library_logprobs(
    model: Any, prompt: Prompt, eos: list[int], k: int, params: SamplingParams | None = None
) -> tuple[list[int], list[tuple[float, list[int]]]]:
    """The library's greedy ``generate()`` on the prompt alone: its tokens, and for each
    the log probability the model's own logits (before any processor) gave it, with the
    ``k`` likeliest tokens there."""
    out = library_generate(
        model, prompt, eos, params, output_logits=True, return_dict_in_generate=True
    )
    tokens = out.sequences[0, len(prompt.ids) :].tolist()
    found = []
    for step, token in zip(out.logits, tokens, strict=False):
        logprobs = torch.log_softmax(step[0].float(), dim=-1)
        found.append((float(logprobs[token]), logprobs.topk(k).indices.tolist()))
    return tokens, found


def assert_logprobs_match(
    completion: Completion, expected: list[tuple[float, list[int]]], k: int
) -> None:
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids) == len(expected)
    for got, token, (logprob, top) in zip(
        completion.logprobs, completion.token_ids, expected, strict=True
    ):
        assert got.token == token
        assert got.logprob == pytest.approx(logprob, abs=1e-4)
        assert [t for t, _ in got.top] == top and len(got.top) == k
        values = [v for _, v in got.top]
        assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("arch", ARCHES)
def test_logprobs_are_the_models_own_distribution_as_generate_sees_it(arch: str) -> None:
    """Jobs asking for logprobs (some adjusted by a bias) share steps with others; each
    token's log probability and its likeliest alternatives are those of the library's
    own logits for that prompt alone, before any bias."""
    rng = random.Random(29)
    model = library_model(arch)
    eos = list(loaded(arch).runner.eos_ids)
    cases = [Prompt(p.ids[:60], max(p.max_tokens, 6)) for p in prompts(arch, 24, seed=31)]
    asks = [rng.choice([None, 0, 3, 5]) for _ in cases]
    adjusts = [adjusting(rng, p, model.config.vocab_size) if i % 3 == 0 else None
               for i, p in enumerate(cases)]  # fmt: skip
    jobs = []
    for i, (prompt, k, adjust) in enumerate(zip(cases, asks, adjusts, strict=True)):
        request = GenerationRequest(str(i), len(prompt.ids), prompt.max_tokens)
        job = GenerationInput(prompt.ids, prompt.max_tokens, adjust or GREEDY, logprobs=k)
        jobs.append((request, job))
    ended = run(engine(arch), jobs, arrivals(3))
    for i, (prompt, k, adjust) in enumerate(zip(cases, asks, adjusts, strict=True)):
        completion = ended[str(i)]
        if k is None:
            assert completion.logprobs is None
            continue
        tokens, expected = library_logprobs(model, prompt, eos, k, adjust)
        assert list(completion.token_ids) == tokens, i
        assert_logprobs_match(completion, expected, k)
    assert sum(k is not None for k in asks) >= 12


def test_a_resumed_job_keeps_the_logprobs_its_stream_holds() -> None:
    prompt = Prompt(prompts("gpt2", 20, seed=33)[4].ids[:30], 12)
    model, eos = library_model("gpt2"), list(loaded("gpt2").runner.eos_ids)
    tokens, expected = library_logprobs(model, prompt, eos, 2)
    assert len(tokens) == 12
    whole = run(
        engine("gpt2"),
        [
            (
                GenerationRequest("w", len(prompt.ids), 12),
                GenerationInput(prompt.ids, 12, logprobs=2),
            )
        ],
        iter([1] + [0] * 10_000),
    )["w"]
    assert whole.logprobs is not None
    streamed = whole.logprobs[:5]
    request = GenerationRequest("r", len(prompt.ids), 12, generated=5)
    job = GenerationInput(prompt.ids, 12, resumed=tuple(tokens[:5]), shown=tokens[5],
                          logprobs=2, resumed_logprobs=streamed)  # fmt: skip
    resumed = run(engine("gpt2"), [(request, job)], iter([1] + [0] * 10_000))["r"]
    assert resumed.logprobs is not None and resumed.logprobs[:5] == streamed
    assert_logprobs_match(resumed, expected, 2)


@pytest.mark.parametrize("arch", ARCHES)
def test_prompts_sharing_a_prefix_compute_it_once_and_still_equal_generate(arch: str) -> None:
    """Chat-like prompts that begin with one of two system prompts (and a few alike
    whole): the later ones take the prefix's blocks from the cache, their tokens still
    those of the library's generate() on each prompt alone."""
    rng = random.Random(41)
    tokenizer = loaded(arch).runner.tokenizer
    words = CORPUS.read_text(encoding="utf-8").split()
    systems = [tokenizer.encode(" ".join(words[i : i + 60])).ids[:70] for i in (100, 900)]
    cases = []
    for i, p in enumerate(prompts(arch, 40, seed=43)):
        system = systems[i % 2]
        question = p.ids[: rng.choice([1, 5, 20])] if i % 7 else ()  # a few: the system alone
        cases.append(Prompt((*system, *question), rng.choice([2, 6, 12])))
    size = engine(arch).scheduler.limits.block_size
    cached: dict[str, int] = {}
    jobs = []
    for i, prompt in enumerate(cases):
        prefix = prefix_hashes(prompt.ids, size)
        request = GenerationRequest(str(i), len(prompt.ids), prompt.max_tokens, prefix=prefix)
        jobs.append((request, GenerationInput(prompt.ids, prompt.max_tokens)))
    ended = run(
        engine(arch), jobs, arrivals(9), on_step=lambda events: cached.update(events.plan.cached)
    )
    mismatched = [
        i for i, p in enumerate(cases) if list(ended[str(i)].token_ids) != reference(arch, p)
    ]
    assert mismatched == []
    assert len(cached) >= 30, cached  # most found their system prompt computed
    assert max(cached.values()) >= 64


@cache
def neox_folder() -> Path:
    """A GPT-NeoX-shaped model (an architecture Ferry does not step) beside the gpt2 tokenizer."""
    from transformers import GPTNeoXConfig

    base = lm_folder("gpt2")
    folder = base.parent / "gpt-neox"
    if not folder.exists():
        tokenizer_files = [p for p in base.iterdir() if "token" in p.name or "special" in p.name]
        vocab = loaded("gpt2").runner.model.config.vocab_size
        eos = min(loaded("gpt2").runner.eos_ids)
        config = GPTNeoXConfig(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=1024, bos_token_id=eos,
            eos_token_id=eos,
        )  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        for path in tokenizer_files:
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


@cache
def neox_runtime() -> CausalLMRuntime:
    settings = GenerationSettings(max_running=8, step_tokens=1024)
    options = RuntimeOptions("cpu", cpu_threads=1)
    runtime = CausalLMRuntime("neox", neox_folder(), settings, options)
    runtime.load()
    return runtime


def test_an_architecture_not_stepped_natively_runs_through_generate_on_whole_batches() -> None:
    runtime = neox_runtime()
    assert runtime.execution == "generate"
    assert "gpt_neox" in runtime.why
    cases = [Prompt(p.ids[:60], p.max_tokens) for p in prompts("gpt2", 20, seed=7)]

    def fresh() -> GenerationEngine:
        return GenerationEngine(GenerationScheduler(runtime.limits), runtime.runner)

    batches: list[int] = []
    ended = run(
        fresh(),
        [greedy(str(i), p) for i, p in enumerate(cases)],
        arrivals(3),
        on_step=lambda events: batches.append(len(events.plan.prefill)),
    )
    assert max(batches) > 1  # whole batches, not one at a time
    for i, prompt in enumerate(cases):
        completion = ended[str(i)]
        assert 1 <= len(completion.token_ids) <= prompt.max_tokens
        assert completion.finish_reason in ("stop", "length")
    # A job alone is the library's generate() on it.
    alone = run(fresh(), [greedy("a", cases[0])], iter([1]))["a"]
    library = AutoModelForCausalLM.from_pretrained(neox_folder()).eval()
    ids = torch.tensor([cases[0].ids])
    with torch.inference_mode():
        out = library.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=cases[0].max_tokens, pad_token_id=runtime.runner.eos_ids[0],
        )  # fmt: skip
    assert list(alone.token_ids) == out[0, len(cases[0].ids) :].tolist()


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_half_precision_keeps_weights_and_kv_in_that_type_at_half_the_bytes(
    precision: str, dtype: torch.dtype
) -> None:
    options = RuntimeOptions("cpu", precision=precision, cpu_threads=1)
    runtime = CausalLMRuntime("half", lm_folder("llama"), GenerationSettings(), options)
    runtime.load()
    assert runtime.runner.pool.keys[0].dtype == dtype
    assert next(runtime.runner.model.parameters()).dtype == dtype
    assert runtime.bytes_per_block * 2 == loaded("llama").bytes_per_block
    eng = GenerationEngine(GenerationScheduler(runtime.limits), runtime.runner)
    cases = prompts("llama", 10)
    ended = run(eng, [greedy(str(i), p) for i, p in enumerate(cases)], arrivals(1))
    vocab = runtime.runner.model.config.vocab_size
    for i, prompt in enumerate(cases):
        tokens = ended[str(i)].token_ids
        assert 1 <= len(tokens) <= prompt.max_tokens
        assert all(0 <= t < vocab for t in tokens)


@pytest.mark.parametrize("arch", ARCHES)
def test_a_job_taken_over_keeps_the_token_its_stream_showed_whatever_is_computed(
    arch: str,
) -> None:
    """A takeover computes the stream's last token again and keeps the one shown: the same
    in full precision (the output is generate()'s), and the stream's where a reduced
    precision would have rounded otherwise (here: a token generate() would not pick)."""
    prompt = Prompt(prompts(arch, 40, seed=9)[0].ids[:30], 24)
    ref = reference(arch, prompt)
    assert len(ref) > 8, "the reference ended too soon to resume in it"
    vocab = library_model(arch).config.vocab_size
    eos = loaded(arch).runner.eos_ids
    other = next(t for t in range(ref[5] + 1, ref[5] + vocab) if t % vocab not in eos) % vocab
    jobs = []
    for name, shown in (("same", ref[5]), ("other", other)):
        request = GenerationRequest(name, len(prompt.ids), prompt.max_tokens, generated=5)
        job = GenerationInput(prompt.ids, prompt.max_tokens, resumed=tuple(ref[:5]), shown=shown)
        jobs.append((request, job))
    ended = run(engine(arch), jobs, iter([2] + [0] * 10_000))
    assert list(ended["same"].token_ids) == ref
    after = reference(arch, Prompt((*prompt.ids, *ref[:5], other), prompt.max_tokens - 6))
    assert list(ended["other"].token_ids) == [*ref[:5], other, *after]


def test_the_whole_batch_path_applies_the_same_bias_and_penalties() -> None:
    """Through generate() on whole batches, two adjusted jobs (one call: they sample
    alike; run apart from a plain one) equal the library's generate() on the same
    left-padded batch with OpenAI's definition, which counts no prompt token."""
    runtime = neox_runtime()
    by_length = sorted((p.ids for p in prompts("gpt2", 20, seed=23)), key=len)
    short = Prompt(next(ids for ids in by_length if len(ids) >= 4)[:8], 16)
    long = Prompt(by_length[-1][:40], 16)
    assert len(short.ids) + 10 < len(long.ids)
    adjust = SamplingParams(
        temperature=0.0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias=((long.ids[-1], 3.0), (short.ids[-1], 3.0)),
    )
    jobs = [(GenerationRequest("plain", len(long.ids), 16), GenerationInput(long.ids, 16))]
    for name, prompt in (("short", short), ("long", long)):
        request = GenerationRequest(name, len(prompt.ids), 16)
        jobs.append((request, GenerationInput(prompt.ids, 16, adjust)))
    eng = GenerationEngine(GenerationScheduler(runtime.limits), runtime.runner)
    ended = run(eng, jobs, iter([3]))
    library = AutoModelForCausalLM.from_pretrained(neox_folder()).eval()
    pad = runtime.runner.eos_ids[0]
    ids = torch.tensor([[pad] * (len(long.ids) - len(short.ids)) + list(short.ids), list(long.ids)])
    mask = (torch.arange(len(long.ids)) >= len(long.ids) - len(short.ids)).long()
    mask = torch.stack([mask, torch.ones_like(mask)])
    made = {}
    for name, batch, attention, processors in (
        ("plain", ids[1:], mask[1:], []),
        ("adjusted", ids, mask, [OpenAIAdjust(adjust, len(long.ids))]),
    ):
        with torch.inference_mode():
            out = library.generate(
                input_ids=batch, attention_mask=attention, do_sample=False, max_new_tokens=16,
                pad_token_id=pad, logits_processor=LogitsProcessorList(processors),
            )  # fmt: skip
        made[name] = out[:, len(long.ids) :].tolist()
    assert list(ended["plain"].token_ids) == made["plain"][0]
    for row, name in enumerate(("short", "long")):
        expected = made["adjusted"][row]
        if pad in expected:  # generate() pads a row that ended before the others
            expected = expected[: expected.index(pad) + 1]
        assert list(ended[name].token_ids) == expected, name
    assert made["plain"][0] != made["adjusted"][1]


def test_the_whole_batch_path_gives_the_same_logprobs() -> None:
    runtime = neox_runtime()
    prompt = Prompt(prompts("gpt2", 10, seed=37)[1].ids[:30], 10)
    jobs = [
        (GenerationRequest("a", len(prompt.ids), 10), GenerationInput(prompt.ids, 10, logprobs=4)),
        (GenerationRequest("b", len(prompt.ids), 10), GenerationInput(prompt.ids, 10)),
    ]
    eng = GenerationEngine(GenerationScheduler(runtime.limits), runtime.runner)
    ended = run(eng, jobs, iter([2]))
    library = AutoModelForCausalLM.from_pretrained(neox_folder()).eval()
    eos = list(runtime.runner.eos_ids)
    tokens, expected = library_logprobs(library, prompt, eos, 4)
    assert list(ended["a"].token_ids) == tokens
    assert_logprobs_match(ended["a"], expected, 4)
    assert ended["b"].logprobs is None


def library_prompt_logprobs(
    model: Any, ids: tuple[int, ...], k: int
) -> list[tuple[float, list[int]]]:
    """Each prompt token's log probability given those before it, from one forward of the
    prompt through the library's model, with the ``k`` likeliest tokens at its place."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [
        (float(logprobs[p, ids[p + 1]]), logprobs[p].topk(k).indices.tolist())
        for p in range(len(ids) - 1)
    ]


def assert_prompt_scored(completion: Completion, ids: tuple[int, ...], k: int, model: Any) -> None:
    found = completion.prompt_logprobs
    assert found is not None and completion.prompt_ids == ids
    assert len(found) == len(ids) and found[0] is None
    expected = library_prompt_logprobs(model, ids, k)
    for position, (got, (logprob, top)) in enumerate(zip(found[1:], expected, strict=True)):
        assert got is not None and got.token == ids[position + 1], position
        assert got.logprob == pytest.approx(logprob, abs=1e-4), position
        assert [t for t, _ in got.top] == top, position


@pytest.mark.parametrize("arch", ARCHES)
def test_a_scored_prompts_logprobs_are_the_librarys_for_every_position(arch: str) -> None:
    """Prompts asking for their own logprobs, some past a prefill chunk (64 tokens here),
    share steps with others: each position's is the library's forward of the prompt
    alone, and what they generate is still generate()'s."""
    rng = random.Random(41)
    model = library_model(arch)
    cases = [p for p in prompts(arch, 40, seed=43) if len(p.ids) >= 2][:18]
    asks = [rng.choice([None, 0, 2]) if i % 4 else 3 for i in range(len(cases))]
    jobs = [
        (
            GenerationRequest(str(i), len(p.ids), p.max_tokens),
            GenerationInput(p.ids, p.max_tokens, prompt_logprobs=k),
        )
        for i, (p, k) in enumerate(zip(cases, asks, strict=True))
    ]
    ended = run(engine(arch), jobs, arrivals(5))
    for i, (prompt, k) in enumerate(zip(cases, asks, strict=True)):
        completion = ended[str(i)]
        assert list(completion.token_ids) == reference(arch, prompt), i
        if k is None:
            assert completion.prompt_logprobs is None
        else:
            assert_prompt_scored(completion, prompt.ids, k, model)
    scored = [p for p, k in zip(cases, asks, strict=True) if k is not None]
    assert len(scored) >= 8 and any(len(p.ids) > 64 for p in scored)


def test_a_scored_prompt_taken_over_is_scored_whole_again() -> None:
    """A job resumed from its streamed tokens prefills prompt and tokens again; its
    prompt's logprobs are the prompt's alone, every position once."""
    prompt = Prompt(prompts("gpt2", 20, seed=47)[3].ids[:90], 10)
    tokens = reference("gpt2", prompt)
    request = GenerationRequest("r", len(prompt.ids), 10, generated=4)
    job = GenerationInput(
        prompt.ids, 10, resumed=tuple(tokens[:4]), shown=tokens[4], prompt_logprobs=1
    )
    resumed = run(engine("gpt2"), [(request, job)], iter([1] + [0] * 10_000))["r"]
    assert list(resumed.token_ids) == tokens
    assert_prompt_scored(resumed, prompt.ids, 1, library_model("gpt2"))


def test_the_whole_batch_path_scores_a_prompt_too() -> None:
    runtime = neox_runtime()
    # Past one forward's 128 positions: scored in three, each on the KV of the ones before.
    long = tuple(t for p in prompts("gpt2", 40, seed=53) for t in p.ids)[:300]
    assert len(long) == 300
    prompt = Prompt(long, 4)
    scored = GenerationInput(prompt.ids, 4, prompt_logprobs=2)
    jobs = [
        (GenerationRequest("a", len(prompt.ids), 4), scored),
        (GenerationRequest("b", len(prompt.ids), 4), GenerationInput(prompt.ids, 4)),
    ]
    eng = GenerationEngine(GenerationScheduler(runtime.limits), runtime.runner)
    ended = run(eng, jobs, iter([2]))
    library = AutoModelForCausalLM.from_pretrained(neox_folder()).eval()
    assert_prompt_scored(ended["a"], prompt.ids, 2, library)
    assert ended["b"].prompt_logprobs is None


def test_a_tokens_logprob_entry_keeps_its_own_bytes_where_it_is_part_of_a_character() -> None:
    from core.models.generation import token_logprob_entry

    tokenizer = lm_folder("gpt2") / "tokenizer.json"
    snowman = "☃".encode()  # three bytes, each a token of the byte-level vocabulary alone
    ids = [loaded("gpt2").runner.tokenizer.token_to_id(chr(byte)) for byte in (0x21, 0x41)]
    whole = token_logprob_entry(tokenizer, ids[0], -0.5, [(ids[1], -1.0)])
    assert (whole["text"], whole["bytes"]) == ("!", [0x21])
    assert whole["top_logprobs"][0]["bytes"] == [0x41]
    pieces = []
    for byte in snowman:
        piece = next(
            id
            for id in range(library_model("gpt2").config.vocab_size)
            if token_logprob_entry(tokenizer, id, 0.0, [])["bytes"] == [byte]
        )
        entry = token_logprob_entry(tokenizer, piece, 0.0, [])
        assert entry["text"] == "\ufffd"  # alone, half a character
        pieces += entry["bytes"]
    assert bytes(pieces).decode() == "☃"  # joined, the character again
