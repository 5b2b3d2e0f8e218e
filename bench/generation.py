# ruff: noqa: RUF001
"""Text generation: Ferry's step-level batching against static generate() batches and one
request at a time, on one model folder, in one process, repeated.

The model is a folder ``ferry.lm_build`` writes (llama-shaped, random weights,
its tokenizer trained on Ferry's corpus); the same folder serves all three:

* **ferry**: ``backends.generation.CausalLMRuntime`` (paged attention, one
  forward a step for every running sequence) driven by
  ``workers.gpu.engine.GenerationEngine`` on the real clock;
* **static**: ``AutoModelForCausalLM.from_pretrained(folder)`` (the library's
  default attention), batches of B in arrival order through ``generate()``,
  B the best of ``--grid`` on the offline load, chosen once per run;
* **single**: the same model, ``generate()`` on each prompt alone.

The workload (``bench.generation_workload``): ``--requests`` prompts of the
shipped corpus with lognormal prompt and output lengths, all arriving at 0
(offline) and, in a second pass, as an open-loop Poisson process at ``--load``
(70 %) of Ferry's measured capacity. Each round runs, interleaved, ferry,
static, single offline, then the same on the Poisson arrivals, then Ferry on
the chunked-prefill load with ``prefill_chunk_tokens`` 0 and 256, then Ferry
on a load of chat-like requests that begin with one of two long system
prompts, with prefix caching off and on. After the rounds one Ferry run is
profiled: where a step's milliseconds go.

    python -m bench.generation [--rounds 3] [--requests 48] [--smoke]
                               [--device cuda --precision bf16 --layers 12 --hidden 768]
                               [--out bench/results/generation.json]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench import results
from bench.generation_workload import (
    OUTPUTS,
    PROMPTS,
    ChunkedLoad,
    Lengths,
    PrefixLoad,
    Request,
    RunFigures,
    Workload,
    add_shared_options,
    arriving,
    decoders_figures,
    draw_workload,
    poisson_arrivals,
    ratio_spread,
    summary,
    workload_facts,
)
from bench.report import (
    Doc,
    Figure,
    Results,
    Spread,
    counted,
    decimal,
    measured_on,
    percent,
    table,
    times,
    verdict,
)

SYSTEMS = ("ferry", "static", "single")
MODES = ("offline", "poisson")
FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
# The spec's targets: output tokens/s against each baseline, at the same or better p99 TTFT.
TARGETS = {"static": 2.0, "single": 5.0}
SMOKE_PROMPTS = Lengths(median=24.0, sigma=1.0, low=4, high=200)
SMOKE_OUTPUTS = Lengths(median=8.0, sigma=0.5, low=4, high=32)
SMOKE_CHUNKED = ChunkedLoad(
    decoders=4, decoder_tokens=24, long_prompts=2, long_prompt=300, long_tokens=4, every_s=0.05
)
SMOKE_PREFIX = PrefixLoad(system_tokens=64, requests=6, question_tokens=8, output_tokens=4,
                          every_s=0.02)  # fmt: skip
# The prefix caching comparison's figures, off and on.
PREFIX_FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "computed_per_request")


@dataclass(frozen=True)
class Setup:
    """Everything the runs share: the model folder loaded twice, the corpus's tokens."""

    runtime: Any  # backends.generation.CausalLMRuntime, loaded
    reference: Any  # the folder through from_pretrained, with its default attention
    corpus_ids: list[int]
    pad_id: int
    device: str
    parameters: int


def load(args: argparse.Namespace, folder: Path) -> Setup:
    import torch
    from transformers import AutoModelForCausalLM

    from backends.base import RuntimeOptions
    from backends.generation import CausalLMRuntime, GenerationSettings
    from backends.generation.load import DTYPES
    from ferry.lm_build import build_lm, corpus_text, parameter_count

    build_lm(folder, "llama", layers=args.layers, hidden=args.hidden, heads=args.heads, seed=0)
    settings = GenerationSettings(
        max_running=args.max_running,
        step_tokens=args.step_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        kv_cache_bytes=int(args.kv_gib * 2**30),
    )
    options = RuntimeOptions(device=args.device, precision=args.precision, cpu_threads=args.threads)
    runtime = CausalLMRuntime("bench-lm", folder, settings, options)
    runtime.load()
    if runtime.execution != "step":
        raise RuntimeError(f"the model is not stepped natively: {runtime.why}")
    # End-of-sequence ends nothing (see bench.generation_runs): all three do the same work.
    if not isinstance(runtime.runner.eos_ids, frozenset):
        raise RuntimeError("the step runtime's eos_ids changed shape: update the benchmark")
    runtime.runner.eos_ids = frozenset()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.precision])
    reference = reference.to(args.device).eval()
    torch.set_num_threads(args.threads)  # the same threads for the reference's runs
    corpus_ids = runtime.runner.tokenizer.encode(corpus_text()).ids
    pad_id = int(reference.generation_config.pad_token_id)
    return Setup(runtime, reference, corpus_ids, pad_id, args.device, parameter_count(folder))


@contextmanager
def cpu_share() -> Iterator[list[float]]:
    """The process's CPU seconds over the wall's while the block ran (how much of a core
    it had: on a shared machine, what the others left it)."""
    found: list[float] = []
    cpu, wall = time.process_time(), time.perf_counter()
    yield found
    found.append(round((time.process_time() - cpu) / (time.perf_counter() - wall), 3))


def limits_with(setup: Setup, **changes: int) -> Any:
    from dataclasses import replace

    return replace(setup.runtime.limits, **changes)


def ferry(setup: Setup, requests: Sequence[Request], **changes: int) -> dict[str, Any]:
    from bench.generation_runs import run_ferry

    with cpu_share() as share:
        run = run_ferry(setup.runtime.runner, limits_with(setup, **changes), requests)
    return {**summary(list(run.records.values())), **run.figures(), "cpu_share": share[0]}


def generate(setup: Setup, requests: Sequence[Request], size: int) -> dict[str, Any]:
    from bench.generation_runs import run_generate

    with cpu_share() as share:
        records = run_generate(setup.reference, requests, size, setup.pad_id, setup.device)
    return {**summary(records), "cpu_share": share[0]}


def chunked(setup: Setup, load: ChunkedLoad, chunk: int, seed: int) -> dict[str, Any]:
    from bench.generation_runs import run_ferry

    requests = load.draw(setup.corpus_ids, seed)
    step_tokens = max(setup.runtime.limits.step_tokens, load.long_prompt + load.decoders)
    limits = limits_with(setup, prefill_chunk_tokens=chunk, step_tokens=step_tokens)
    run = run_ferry(setup.runtime.runner, limits, requests)
    return {**decoders_figures(run.token_times_s, run.records), **run.figures()}


def prefixed(setup: Setup, load: PrefixLoad, caching: bool, seed: int) -> dict[str, Any]:
    from bench.generation_runs import run_ferry

    requests = load.draw(setup.corpus_ids, seed)
    run = run_ferry(setup.runtime.runner, setup.runtime.limits, requests, prefix_caching=caching)
    found = {**summary(list(run.records.values())), **run.figures()}
    # The prompt tokens the step computed, a request: the decodes' one a token taken off.
    prompts = found["computed_tokens"] - sum(max(0, r.max_tokens - 1) for r in requests)
    return {**found, "computed_per_request": round(prompts / len(requests), 1)}


def calibrate(
    setup: Setup, offline: list[Request], grid: Sequence[int], load: float, seed: int
) -> dict[str, Any]:
    """Warm both models up, then measure Ferry's capacity and the best static batch size."""
    warm = offline[: min(4, len(offline))]
    ferry(setup, warm)
    generate(setup, warm, len(warm))
    capacity = ferry(setup, offline)
    by_size = {size: generate(setup, offline, size)["tokens_per_s"] for size in grid}
    best = max(by_size, key=lambda size: by_size[size])
    rate_per_s = load * len(offline) / capacity["span_s"]
    print(
        f"ferry offline {capacity['tokens_per_s']:.0f} tokens/s; static by size "
        + ", ".join(f"{s}: {v:.0f}" for s, v in by_size.items())
        + f"; static batch {best}; Poisson at {rate_per_s:.2f} requests/s",
        flush=True,
    )
    return {
        "ferry_offline": capacity,
        "static_tokens_per_s_by_size": {str(s): v for s, v in by_size.items()},
        "static_batch": best,
        "poisson_rate_per_s": round(rate_per_s, 4),
        "poisson_seed": seed,
    }


@dataclass
class Calibration:
    ferry_offline: RunFigures  # Ferry alone on the offline workload: its capacity
    static_tokens_per_s_by_size: dict[int, float]  # the static batch grid
    static_batch: int  # the grid's best
    poisson_rate_per_s: float | None = None
    poisson_seed: int | None = None


@dataclass
class ChunkedRun:
    """One prefill chunk size on the chunked load: the decodes' pace, the long prompts' wait."""

    decode_tpot_p99_ms: float
    decode_gap_p50_ms: float
    decode_gap_p99_ms: float
    decode_gap_max_ms: float
    long_ttft_p50_ms: float
    peak_kv_blocks: int
    kv_blocks: int
    steps: int
    step_ms_mean: float
    computed_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class Round:
    offline: dict[str, RunFigures]  # by system: ferry, static, single
    poisson: dict[str, RunFigures] | None = None
    chunked: dict[int, ChunkedRun] | None = None  # by prefill_chunk_tokens
    prefix: dict[str, RunFigures] | None = None  # by prefix caching: off, on


@dataclass
class ModeFigures:
    """One arrival mode over the rounds: each system's figures, and Ferry's ratios."""

    ferry: dict[str, Spread]
    static: dict[str, Spread]
    single: dict[str, Spread]
    ratios: dict[str, Spread]  # vs_static, vs_single, round by round


@dataclass
class Target:
    tokens_per_s_ratio_at_least: float
    ratio: Spread
    ratio_met: bool
    ttft_p99_same_or_better: bool  # every round, both arrivals
    met: bool


@dataclass
class Ceiling:
    """What any batching could reach: the model's own cost, and the others' spans over it."""

    fixed_ms: float
    per_token_ms: float
    tokens: int
    floor_s: float
    vs_single: Spread | None
    vs_static: Spread | None
    # A scheduler that steps (one token a sequence a step, as Ferry's and every
    # continuous batcher's): at least as many forwards as the longest output's tokens.
    decode_ms: float | None = None  # one sequence's one-token forward, on its KV cache
    steps: int | None = None
    stepped_floor_s: float | None = None
    vs_single_stepped: Spread | None = None


@dataclass
class Profile:
    steps: int
    per_step_ms: dict[str, float]  # the step and each part of it
    share_of_step: dict[str, float]
    tokens_per_step_mean: float
    sequences_per_step_mean: float
    sdpa_calls_per_step: float
    us_per_sdpa_call: float
    us_per_attention_call_per_sequence: float


@dataclass
class Report:
    """bench/results/generation.json (and the GPU run's generation_gpu.json) besides its head
    (bench.report.typed reads it)."""

    workload: Workload
    calibration: Calibration
    rounds: list[Round]
    offline: ModeFigures
    targets: dict[str, Target]  # by the system Ferry is held against
    peak_kv_blocks: int
    poisson: ModeFigures | None = None
    chunked: dict[int, dict[str, Spread]] | None = None  # by prefill_chunk_tokens
    # By prefix caching (off, on): each figure, and on over off round by round.
    prefix: dict[str, dict[str, Spread]] | None = None
    prefix_ratios: dict[str, Spread] | None = None
    ceiling: Ceiling | None = None
    profile: Profile | None = None
    seconds: float = 0.0  # written with the last file


RESULT = Report


def one_round(
    setup: Setup,
    workloads: dict[str, list[Request]],
    batch: int,
    chunked_load: ChunkedLoad | None,
    seed: int,
    prefix_load: PrefixLoad | None = None,
) -> dict[str, Any]:
    round_: dict[str, Any] = {}
    for mode, requests in workloads.items():
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "ferry": partial(ferry, setup, requests),
            "static": partial(generate, setup, requests, batch),
            "single": partial(generate, setup, requests, 1),
        }
        round_[mode] = {}
        for system, run in runs.items():
            round_[mode][system] = found = run()
            print(
                f"  {mode:8} {system:7} {found['tokens_per_s']:8.1f} tokens/s  TTFT p50 "
                f"{found['ttft_p50_ms']:8.1f} p99 {found['ttft_p99_ms']:8.1f} ms  TPOT p50 "
                f"{found['tpot_p50_ms']:6.1f} p99 {found['tpot_p99_ms']:6.1f} ms",
                flush=True,
            )
    if chunked_load is not None:
        round_["chunked"] = {}
        for chunk in (0, 256):
            found = chunked(setup, chunked_load, chunk, seed)
            round_["chunked"][str(chunk)] = found
            print(
                f"  chunk {chunk:3}: decode TPOT p99 {found['decode_tpot_p99_ms']:.1f} ms, "
                f"gap p99 {found['decode_gap_p99_ms']:.1f} max {found['decode_gap_max_ms']:.1f}"
                f" ms; long prompts' TTFT p50 {found['long_ttft_p50_ms']:.0f} ms",
                flush=True,
            )
    if prefix_load is not None:
        round_["prefix"] = {}
        for caching in (False, True):
            found = prefixed(setup, prefix_load, caching, seed)
            round_["prefix"]["on" if caching else "off"] = found
            print(
                f"  prefix caching {'on ' if caching else 'off'}: {found['tokens_per_s']:.1f} "
                f"tokens/s, TTFT p50 {found['ttft_p50_ms']:.0f} p99 {found['ttft_p99_ms']:.0f} "
                f"ms, {found['computed_per_request']:.0f} prompt tokens computed a request",
                flush=True,
            )
    return round_


def figures(rounds: list[dict[str, Any]], modes: Sequence[str] = MODES) -> dict[str, Any]:
    """Every figure's median and range over the rounds, the ratios, the targets."""
    out: dict[str, Any] = {}
    for mode in modes:
        out[mode] = {
            system: {f: results.spread([r[mode][system][f] for r in rounds]) for f in FIGURES}
            for system in SYSTEMS
        }
        ferry_tps = [r[mode]["ferry"]["tokens_per_s"] for r in rounds]
        out[mode]["ratios"] = {
            f"vs_{system}": ratio_spread(
                ferry_tps, [r[mode][system]["tokens_per_s"] for r in rounds]
            )
            for system in ("static", "single")
        }
    targets = {}
    for system, target in TARGETS.items():
        ratio = out["offline"]["ratios"][f"vs_{system}"]
        # The same or better p99 TTFT, in every round of both arrival patterns.
        ttft_ok = all(
            r[mode]["ferry"]["ttft_p99_ms"] <= r[mode][system]["ttft_p99_ms"]
            for r in rounds
            for mode in modes
        )
        targets[system] = {
            "tokens_per_s_ratio_at_least": target,
            "ratio": ratio,
            "ratio_met": bool(ratio["min"] >= target),
            "ttft_p99_same_or_better": ttft_ok,
            "met": bool(ratio["min"] >= target and ttft_ok),
        }
    out["targets"] = targets
    if all("chunked" in r for r in rounds):
        keys = list(rounds[0]["chunked"]["0"])
        out["chunked"] = {
            chunk: {k: results.spread([r["chunked"][chunk][k] for r in rounds]) for k in keys}
            for chunk in ("0", "256")
        }
    if all("prefix" in r for r in rounds):
        out["prefix"] = {
            state: {k: results.spread([r["prefix"][state][k] for r in rounds]) for k in keys}
            for state in ("off", "on")
            for keys in [PREFIX_FIGURES]
        }
        out["prefix_ratios"] = {
            k: ratio_spread(
                [r["prefix"]["on"][k] for r in rounds], [r["prefix"]["off"][k] for r in rounds]
            )
            for k in PREFIX_FIGURES
        }
    out["peak_kv_blocks"] = max(r[m]["ferry"]["peak_kv_blocks"] for r in rounds for m in modes)
    return out


# Forward lengths the model's own cost per token is measured at: its slope between them.
FLOOR_TOKENS = (64, 256)


def compute_floor(setup: Setup, repeats: int = 5) -> dict[str, float]:
    """The model's own cost on this device: the library's forward of one sequence of
    FLOOR_TOKENS tokens (median of ``repeats``), as a fixed cost a call plus a cost a token.

    A token costs any batching at least the per-token part, so a workload of N prompt and
    output tokens takes at least N times it: what Ferry's ratios can reach on this device.
    """
    import statistics

    import torch

    def seconds(tokens: int) -> float:
        ids = torch.tensor([setup.corpus_ids[:tokens]], device=setup.device)
        times = []
        with torch.inference_mode():
            for number in range(repeats + 1):
                began = time.perf_counter()
                setup.reference(input_ids=ids, use_cache=False)
                if setup.device.startswith("cuda"):
                    torch.cuda.synchronize()
                if number:  # the first warms up
                    times.append(time.perf_counter() - began)
        return statistics.median(times)

    def decode_seconds(context: int, steps: int = 20) -> float:
        """One token's forward on the KV cache of ``context`` tokens (a decode step): the
        fastest of ``steps``, on a shared host the nearest to what a step needs at least."""
        ids = torch.tensor([setup.corpus_ids[:context]], device=setup.device)
        times = []
        with torch.inference_mode():
            cache = setup.reference(input_ids=ids, use_cache=True).cache
            token = ids[:, -1:]
            for number in range(steps + 1):
                began = time.perf_counter()
                cache = setup.reference(input_ids=token, cache=cache, use_cache=True).cache
                if setup.device.startswith("cuda"):
                    torch.cuda.synchronize()
                if number:
                    times.append(time.perf_counter() - began)
        return min(times)

    short, long = FLOOR_TOKENS
    short_s, long_s = seconds(short), seconds(long)
    per_token_s = max(0.0, (long_s - short_s) / (long - short))
    return {
        "per_token_ms": round(per_token_s * 1000, 4),
        "fixed_ms": round(max(0.0, short_s - short * per_token_s) * 1000, 3),
        "decode_ms": round(decode_seconds(short) * 1000, 3),
    }


def ceiling(
    floor: dict[str, float], requests: Sequence[Request], rounds: list[dict[str, Any]]
) -> dict[str, Any]:
    """The best ratio over one at a time (and static batches) any batching could reach on the
    offline workload: each round's span of theirs over the workload's tokens at the model's
    own cost per token (every prompt token, and every output token but the last, goes through
    the model once)."""
    tokens = sum(len(r.prompt_ids) + r.max_tokens - 1 for r in requests)
    floor_s = tokens * floor["per_token_ms"] / 1000.0
    found: dict[str, Any] = {**floor, "tokens": tokens, "floor_s": round(floor_s, 3)}
    for system in ("single", "static"):
        spans = [r["offline"][system]["span_s"] for r in rounds]
        found[f"vs_{system}"] = (
            results.spread([span / floor_s for span in spans]) if floor_s else None
        )
    if "decode_ms" in floor:
        # Stepped, the longest request's tokens take a step each, each step a forward of
        # at least one token (decode_ms), and every token beyond one a step at least the
        # per-token cost: an estimate of the best any scheduler that steps could do (the
        # cost of a forward of 2 to 64 tokens is taken as linear, not measured).
        steps = max(r.max_tokens for r in requests)
        stepped_s = (steps * floor["decode_ms"] + (tokens - steps) * floor["per_token_ms"]) / 1e3
        spans = [r["offline"]["single"]["span_s"] for r in rounds]
        found |= {
            "steps": steps,
            "stepped_floor_s": round(stepped_s, 3),
            "vs_single_stepped": results.spread([span / stepped_s for span in spans])
            if stepped_s
            else None,
        }
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_options(parser)
    parser.add_argument("--grid", default="4,8,16,32", help="static batch sizes to try")
    parser.add_argument("--load", type=float, default=0.7, help="Poisson rate, of capacity")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--kv-gib", type=float, default=0.0, help="0: the backend's default")
    parser.add_argument("--modes", default=",".join(MODES), help="arrivals: offline,poisson")
    parser.add_argument("--no-chunked", action="store_true", help="skip the chunked prefill runs")
    parser.add_argument("--no-prefix", action="store_true", help="skip the prefix caching runs")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/generation.json"))
    args = parser.parse_args(argv)
    smoke = args.smoke or os.environ.get(results.SMOKE_ENV) == "1"
    if smoke:
        args.rounds, args.requests, args.grid = 1, min(args.requests, 8), "4"
        args.layers, args.hidden, args.heads = 2, 128, 4
    head = results.provenance("generation", argv)
    head["smoke"] = smoke  # --smoke alone, without the runner's variable, is a smoke run too
    started = time.monotonic()
    prompts, outputs = (SMOKE_PROMPTS, SMOKE_OUTPUTS) if smoke else (PROMPTS, OUTPUTS)
    chunked_load = None if args.no_chunked else (SMOKE_CHUNKED if smoke else ChunkedLoad())
    prefix_load = None if args.no_prefix else (SMOKE_PREFIX if smoke else PrefixLoad())
    grid = [int(s) for s in args.grid.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    if "offline" not in modes or not set(modes) <= set(MODES):
        parser.error(f"--modes: offline, and optionally poisson (not {args.modes})")
    with tempfile.TemporaryDirectory(prefix="ferry-bench-lm-") as tmp:
        setup = load(args, Path(tmp) / "lm")
        offline = draw_workload(setup.corpus_ids, args.requests, args.seed, prompts, outputs)
        calibration = calibrate(setup, offline, grid, args.load, args.seed + 1)
        arrivals = poisson_arrivals(len(offline), calibration["poisson_rate_per_s"], args.seed + 1)
        workloads = {"offline": offline, "poisson": arriving(offline, arrivals)}
        workloads = {mode: workloads[mode] for mode in modes}
        settings = run_settings(args, setup, grid, smoke)
        static_batch = calibration["static_batch"]
        rounds: list[dict[str, Any]] = []
        report: dict[str, Any] = {}
        for number in range(1, args.rounds + 1):
            print(f"round {number} of {args.rounds}", flush=True)
            rounds.append(
                one_round(setup, workloads, static_batch, chunked_load, args.seed, prefix_load)
            )
            report = {
                "workload": {
                    **workload_facts(offline, prompts, outputs),
                    "chunked": asdict(chunked_load) if chunked_load else None,
                    "prefix": asdict(prefix_load) if prefix_load else None,
                },
                "calibration": calibration,
                "rounds": rounds,
                **figures(rounds, modes),
            }
            # Written after every round: a run cut short still leaves what it measured.
            results.write(args.out, report, settings=settings, head=head)
        report["ceiling"] = ceiling(compute_floor(setup), offline, rounds)
        print(f"ceiling: {report['ceiling']}", flush=True)
        if not args.no_profile:
            from bench.generation_profile import profile

            report["profile"] = profile(setup.runtime, offline)
            print(f"profile: {report['profile']['per_step_ms']}", flush=True)
        report["seconds"] = round(time.monotonic() - started, 1)
        results.write(args.out, report, settings=settings, head=head)
    print(f"wrote {args.out} in {report['seconds']:.0f} s")
    return 0


def run_settings(args: argparse.Namespace, setup: Setup, grid: list[int], smoke: bool) -> dict:
    limits = setup.runtime.limits
    return {
        "smoke": smoke,
        "model": {
            "arch": "llama",
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": setup.reference.config.num_key_value_heads,
            "intermediate": setup.reference.config.intermediate_size,
            "vocab_size": setup.reference.config.vocab_size,
            "parameters": setup.parameters,
        },
        "device": args.device,
        "precision": args.precision,
        "threads": args.threads,
        "requests": args.requests,
        "rounds": args.rounds,
        "seed": args.seed,
        "static_grid": grid,
        "modes": args.modes.split(","),
        "poisson_load": args.load,
        "eos": "ignored: every request generates exactly its max_tokens",
        "ferry": {
            "max_running": limits.max_running,
            "step_tokens": limits.step_tokens,
            "prefill_chunk_tokens": limits.prefill_chunk_tokens,
            "kv_blocks": limits.kv_blocks,
            "block_size": limits.block_size,
            "bytes_per_block": setup.runtime.bytes_per_block,
        },
    }


# --- its tables (python -m bench.render) --------------------------------------------------

GENERATION_SYSTEMS = {"ferry": "Ferry", "static": "static generate()", "single": "one at a time"}


GENERATION_MODES = {"offline": "all at 0", "poisson": "Poisson"}


def generation_setup(doc: Doc, report: Report) -> str:
    s, w = doc["settings"], report.workload
    m, cal = s["model"], report.calibration
    grid = ", ".join(f"{b}: {v:,.0f}" for b, v in cal.static_tokens_per_s_by_size.items())
    shares = [
        run.cpu_share
        for r in report.rounds
        for runs in (r.offline, r.poisson or {})
        for run in runs.values()
        if run.cpu_share is not None
    ]
    poisson = (
        f" Poisson at {cal.poisson_rate_per_s:.2f} requests/s "
        f"({percent()(s['poisson_load'])} of Ferry's measured capacity)."
        if report.poisson is not None and cal.poisson_rate_per_s is not None
        else ""
    )
    return (
        f"{measured_on(doc)}; median of "
        f"{counted(len(report.rounds), 'round', 'rounds')} (min–max). A {m['arch']}-shaped "
        f"model of {m['layers']} layers, hidden {m['hidden']} ({m['parameters'] / 1e6:.1f} M "
        f"parameters, random weights), {s['precision']} on `{s['device']}`, "
        f"{counted(s['threads'], 'torch thread', 'torch threads')}; the process had "
        f"{percent()(min(shares))} to {percent()(max(shares))} of a core in the timed runs. "
        f"{s['requests']} requests: prompts {w.prompt_tokens.p50:g} tokens at the median, "
        f"{w.prompt_tokens.max} at most; outputs {w.output_tokens.p50:g} at the "
        f"median, {w.output_tokens.max} at most ({w.output_tokens.total:,} in all, "
        f"EOS ignored).{poisson} Static batches of "
        f"{cal.static_batch}, the best offline of the grid (output tokens/s: {grid}). "
        f"Ferry: max_running {s['ferry']['max_running']}, step_tokens "
        f"{s['ferry']['step_tokens']}, prefill_chunk_tokens {s['ferry']['prefill_chunk_tokens']}; "
        f"its KV pool's peak {report.peak_kv_blocks:,} of {s['ferry']['kv_blocks']:,} blocks."
    )


def generation_figures(doc: Doc, report: Report) -> list[str]:
    """The setup, the table of each arrival mode the file measured, and the ratios."""
    ms = decimal(0, " ms")
    measured = {"offline": report.offline, "poisson": report.poisson}
    modes = {
        mode: (arrivals, found)
        for mode, arrivals in GENERATION_MODES.items()
        if (found := measured[mode]) is not None
    }
    rows = []
    for arrivals, found in modes.values():
        for system, name in GENERATION_SYSTEMS.items():
            f = {k: Figure.summary(v) for k, v in getattr(found, system).items()}
            rows.append(
                [arrivals, name, f["tokens_per_s"].text(decimal(), system == "ferry")]
                + [f[k].text(ms) for k in ("ttft_p50_ms", "ttft_p99_ms")]
                + [f[k].text(decimal(1, " ms")) for k in ("tpot_p50_ms", "tpot_p99_ms")]
            )
    header = ["arrivals", "system", "output tokens/s", "TTFT p50", "TTFT p99", "TPOT p50"]
    lines = [generation_setup(doc, report), "", *table([*header, "TPOT p99"], "llrrrrr", rows)]

    def ratio(found: ModeFigures, system: str) -> str:
        return Figure.summary(found.ratios[f"vs_{system}"]).text(times())

    ratios = "; ".join(
        f"{arrivals}: {ratio(found, 'static')} static, {ratio(found, 'single')} one at a time"
        for arrivals, found in modes.values()
    )
    return [*lines, "", f"Ferry's output tokens/s over the others', round by round: {ratios}."]


def render_generation(results: Results) -> list[str]:
    return generation_figures(results["generation"], results.typed("generation", Report))


def render_generation_offline(results: Results) -> list[str]:
    """The offline arrivals alone, at a larger batch of requests (``--requests 128
    --modes offline``, into generation_offline.json)."""
    doc, report = results["generation_offline"], results.typed("generation_offline", Report)
    return generation_figures(doc, report)


def render_generation_gpu(results: Results) -> list[str]:
    doc, report = results["generation_gpu"], results.typed("generation_gpu", Report)
    return [*generation_figures(doc, report), "", *generation_profile(report)]


def render_generation_targets(results: Results) -> list[str]:
    report = results.typed("generation", Report)
    rows = []
    for system, target in report.targets.items():
        ratio = Figure.summary(target.ratio)
        at_least = target.tokens_per_s_ratio_at_least
        rows.append(
            [
                f"tokens/s ≥ {at_least:g}× {GENERATION_SYSTEMS[system]}, all at 0",
                ratio.text(times(), True),
                "yes" if target.ttft_p99_same_or_better else "no",
                verdict(target.met),
            ]
        )
    header = ["target", "Ferry's ratio", "p99 TTFT same or better, every round, both arrivals"]
    lines = table([*header, "verdict"], "lrll", rows)
    found = report.ceiling
    if found and found.vs_single:
        best = Figure.summary(found.vs_single).text(times(), True)
        lines += [
            "",
            f"What any batching could reach on this device: the model's own forward costs "
            f"{found.fixed_ms:g} ms a call plus {found.per_token_ms:g} ms a token "
            f"(one sequence of 64 and of 256 tokens), so the offline workload's "
            f"{found.tokens:,} tokens take at least {found.floor_s:g} s, and one at a "
            f"time's spans are {best} that floor: the most a scheduler that wastes nothing "
            f"could gain over it here.",
        ]
    if found and found.vs_single_stepped and found.decode_ms and found.steps:
        stepped = Figure.summary(found.vs_single_stepped).text(times(), True)
        lines += [
            "",
            f"A scheduler that steps, as Ferry's does, cannot reach that: its longest "
            f"request's {found.steps} tokens take a step each, and a step is a forward of at "
            f"least one token ({found.decode_ms:g} ms for one sequence on its KV cache here, "
            f"the fastest of 20), so the workload takes it about {found.stepped_floor_s:g} s "
            f"at best ({found.steps} such forwards and {found.per_token_ms:g} ms for each "
            f"other token, a forward's cost taken as linear in its tokens), and one at a "
            f"time's spans are {stepped} that: an estimate of the most step-level batching "
            f"could gain over it on this device (timed once, after the rounds, on a shared "
            f"host).",
        ]
    return lines


def render_generation_chunked(results: Results) -> list[str]:
    report = results.typed("generation", Report)
    load, chunked = report.workload.chunked, report.chunked
    if load is None or chunked is None:
        return ["The chunked-prefill runs were left out of this file's run."]
    ms = decimal(1, " ms")
    rows = [
        [
            "0 (whole prompts)" if chunk == 0 else str(chunk),
            *(
                Figure.summary(found[k]).text(ms)
                for k in ("decode_tpot_p99_ms", "decode_gap_p99_ms", "decode_gap_max_ms")
            ),
            Figure.summary(found["long_ttft_p50_ms"]).text(decimal(0, " ms")),
        ]
        for chunk, found in chunked.items()
    ]
    return [
        f"{load.decoders} requests of {load.decoder_prompt} prompt tokens decode "
        f"{load.decoder_tokens} tokens each; {load.long_prompts} prompts of "
        f"{load.long_prompt} tokens arrive among them, one every {load.every_s:g} s "
        f"(median of {counted(len(report.rounds), 'round', 'rounds')}, min–max):",
        "",
        *table(
            ["prefill_chunk_tokens", "decodes' TPOT p99", "decodes' token gap p99", "gap max",
             "long prompts' TTFT p50"],
            "lrrrr",
            rows,
        ),
    ]  # fmt: skip


def render_generation_prefix(results: Results) -> list[str]:
    report = results.typed("generation", Report)
    load, found, ratios = report.workload.prefix, report.prefix, report.prefix_ratios
    if load is None or found is None or ratios is None:
        return ["The prefix caching runs were left out of this file's run."]

    def ratio(key: str) -> str:
        return Figure.summary(ratios[key]).text(times(2))

    rows = [
        [
            state,
            Figure.summary(found[key]["tokens_per_s"]).text(decimal(1)),
            Figure.summary(found[key]["ttft_p50_ms"]).text(decimal(0, " ms")),
            Figure.summary(found[key]["ttft_p99_ms"]).text(decimal(0, " ms")),
            Figure.summary(found[key]["computed_per_request"]).text(decimal(0)),
        ]
        for key, state in (("off", "off"), ("on", "on (the default)"))
    ]
    return [
        f"{load.requests} requests, one every {load.every_s:g} s, each one of "
        f"{load.systems} system prompts of {load.system_tokens} tokens and a question of "
        f"{load.question_tokens} of its own, generating {load.output_tokens} tokens (median of "
        f"{counted(len(report.rounds), 'round', 'rounds')}, min–max):",
        "",
        *table(
            ["prefix caching", "output tokens/s", "TTFT p50", "TTFT p99",
             "prompt tokens computed a request"],
            "lrrrr",
            rows,
        ),
        "",
        f"On over off, round by round: output tokens/s {ratio('tokens_per_s')}, TTFT p50 "
        f"{ratio('ttft_p50_ms')}, TTFT p99 {ratio('ttft_p99_ms')}, prompt tokens computed "
        f"{ratio('computed_per_request')}.",
    ]  # fmt: skip


def render_generation_profile(results: Results) -> list[str]:
    return generation_profile(results.typed("generation", Report))


def generation_profile(report: Report) -> list[str]:
    found = report.profile
    if found is None:
        return ["The profiled run was left out of this file's run."]
    names = {
        "scheduler": "scheduler (schedule, update_from_output)",
        "runtime_outside_forward": "runtime outside the forward (tables, tensors, sampling, text)",
        "forward_outside_attention": "the library's layers (embeddings, norms, MLPs, head)",
        "attention_outside_sdpa": "paged attention outside SDPA (KV writes, gathers, its loop)",
        "sdpa": "SDPA, once per sequence per layer",
    }
    per_step = found.per_step_ms
    rows = [
        [name, f"{per_step[key]:.2f} ms", percent(1)(found.share_of_step[key])]
        for key, name in names.items()
    ]
    return [
        f"One offline Ferry run, {found.steps:,} steps of {per_step['step']:.1f} ms on "
        f"average, {found.tokens_per_step_mean:.1f} tokens and "
        f"{found.sequences_per_step_mean:.1f} sequences a step; "
        f"{found.sdpa_calls_per_step:.0f} SDPA calls a step at "
        f"{found.us_per_sdpa_call:.0f} µs each; Ferry's attention, all told, "
        f"{found.us_per_attention_call_per_sequence:.0f} µs per sequence per layer:",
        "",
        *table(["part of a step", "a step", "share"], "lrr", rows),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
