# ruff: noqa: RUF001
"""Text generation through the whole stack, as a share of the same engine in one process.

One llama-shaped folder (``ferry.lm_build``, random weights) runs one workload
two ways, in one run, rounds interleaved:

* **in-process**: ``backends.generation.CausalLMRuntime`` driven by
  ``workers.gpu.engine.GenerationEngine`` in this process
  (``bench.generation_runs.run_ferry``), the figure ``bench.generation``
  compares with ``generate()``;
* **stack**: ``ferry up`` (its own Redis, SQLite, the API and one generation
  worker, no Flower) serving the folder as a model of a repository, with the
  same limits. Each request is a client thread: ``POST /v1/jobs`` (the prompt
  as text, greedy), then ``GET /v1/jobs/{id}/events`` read to its ``done``
  event, as a streaming client reads it. Its times are the client's: from the
  moment it posted to each token event it read.

The folder's ``generation_config.json`` names no end-of-sequence token, so
every request generates exactly its ``max_tokens`` both ways (a random-weight
model hits EOS at random). The prompts are windows of the shipped corpus's
tokens, turned into text and counted again the way the API counts them.

    python -m bench.generation_stack [--rounds 3] [--requests 48] [--smoke]
                                     [--out bench/results/generation_stack.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench import results
from bench.generation_workload import (
    OUTPUTS,
    PROMPTS,
    Lengths,
    Record,
    Request,
    RunFigures,
    Workload,
    add_shared_options,
    draw_workload,
    ratio_spread,
    summary,
    workload_facts,
)
from bench.quantiles import quantile
from bench.report import Figure, Results, Spread, counted, decimal, measured_on, percent, table
from harness import webclient
from harness.stack import FerryUp

MODEL = "bench-lm"
SYSTEMS = ("in_process", "stack")
FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
SMOKE_PROMPTS = Lengths(median=24.0, sigma=1.0, low=4, high=200)
SMOKE_OUTPUTS = Lengths(median=8.0, sigma=0.5, low=4, high=32)
# Out of the way of the workload: it measures the path, not the limits.
LIMITS = {"FERRY_RATE_LIMIT": "1000000/second", "FERRY_MAX_OUTSTANDING_JOBS": "100000000"}


@dataclass(frozen=True)
class Model:
    """The model both ways run: its repository (one version) and the limits in model.toml."""

    repository: Path
    folder: Path
    max_running: int
    step_tokens: int
    prefill_chunk_tokens: int
    kv_cache_bytes: int

    def toml(self, context_tokens: int) -> str:
        return (
            f'name = "{MODEL}"\nbackend = "causal-lm"\n'
            'description = "The generation benchmark\'s model: random weights."\n\n'
            '[input]\nkind = "generation"\ntokenizer = "tokenizer.json"\n'
            f"context_tokens = {context_tokens}\ndefault_max_tokens = 16\n\n"
            '[cost]\nfunction = "tokens"\n\n'
            f"[parameters]\nmax_running = {self.max_running}\nstep_tokens = {self.step_tokens}\n"
            f"prefill_chunk_tokens = {self.prefill_chunk_tokens}\n"
            f"kv_cache_bytes = {self.kv_cache_bytes}\n"
        )


@dataclass
class Quote:
    """How the 202's ``estimated_wait_ms`` (a generation's: until its first token) compared
    with the time to first token its client then saw, over one round's requests."""

    quoted: int  # the requests whose 202 carried a quote
    ratio_p10: float  # measured / quoted
    ratio_p50: float
    ratio_p90: float
    within_2x: float  # the share measured within half to twice its quote


QUOTE_FIGURES = ("ratio_p10", "ratio_p50", "ratio_p90", "within_2x")


@dataclass
class Round:
    in_process: RunFigures
    stack: RunFigures
    quote: Quote | None = None  # absent from files written before it was measured


@dataclass
class Report:
    """bench/results/generation_stack.json besides its head (bench.report.typed reads it)."""

    workload: Workload
    rounds: list[Round]
    in_process: dict[str, Spread]  # per figure, over the rounds
    stack: dict[str, Spread]
    stack_share: Spread  # the stack's tokens/s over the engine's, round by round
    ttft_p50_added_ms: Spread
    quote: dict[str, Spread] | None = None  # per QUOTE_FIGURES, over the rounds
    seconds: float = 0.0  # written with the last round's file


RESULT = Report


def build(args: argparse.Namespace, root: Path) -> tuple[Model, int]:
    """The model's repository under ``root``; returns it and its context length."""
    from ferry.lm_build import build_lm

    model = Model(
        repository=root / "repository",
        folder=root / "repository" / MODEL / "1",
        max_running=args.max_running,
        step_tokens=args.step_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        kv_cache_bytes=int(args.kv_mib * 2**20),
    )
    build_lm(
        model.folder, "llama", layers=args.layers, hidden=args.hidden, heads=args.heads, seed=0
    )
    # No end-of-sequence token: every request runs to its max_tokens, both ways.
    config_path = model.folder / "generation_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["eos_token_id"] = []
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    context = int(json.loads((model.folder / "config.json").read_text())["max_position_embeddings"])
    (model.repository / MODEL / "model.toml").write_text(model.toml(context), encoding="utf-8")
    return model, context


class InProcess:
    """The folder loaded here as the worker loads it, stepped by the engine."""

    def __init__(
        self, model: Model, threads: int, device: str = "cpu", precision: str = "fp32"
    ) -> None:
        from backends.base import RuntimeOptions
        from backends.generation import CausalLMRuntime, GenerationSettings

        settings = GenerationSettings(
            max_running=model.max_running,
            step_tokens=model.step_tokens,
            prefill_chunk_tokens=model.prefill_chunk_tokens,
            kv_cache_bytes=model.kv_cache_bytes,
        )
        options = RuntimeOptions(device=device, precision=precision, cpu_threads=threads)
        self.runtime = CausalLMRuntime(MODEL, model.folder, settings, options)
        self.runtime.load()
        if self.runtime.execution != "step" or self.runtime.runner.eos_ids:
            raise RuntimeError("the benchmark's model must be stepped natively, with no EOS")

    def run(self, requests: Sequence[Request]) -> dict[str, Any]:
        from bench.generation_runs import run_ferry

        run = run_ferry(self.runtime.runner, self.runtime.limits, requests)
        return {**summary(list(run.records.values())), "peak_kv_blocks": run.peak_blocks}


def prompts_as_text(folder: Path, requests: Sequence[Request]) -> list[tuple[Request, str]]:
    """Each request's prompt as the text a client sends, and the request with the prompt's
    ids as the API counts that text (the same ids, for a byte-level BPE, but never assumed)."""
    from core.models.generation import prompt_token_ids
    from core.models.inputs import load_tokenizer

    tokenizer = folder / "tokenizer.json"
    decoded = []
    for r in requests:
        text = load_tokenizer(tokenizer).decode(list(r.prompt_ids), skip_special_tokens=False)
        ids = tuple(prompt_token_ids({"prompt": text}, tokenizer))
        decoded.append((replace(r, prompt_ids=ids), text))
    return decoded


def read_events(client: httpx.Client, job_id: str, start: float) -> list[float]:
    """The job's token events' times (since ``start``) until its done event."""
    times: list[float] = []
    kind = ""
    with client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("event:"):
                kind = line.partition(":")[2].strip()
            elif line.startswith("data:") and kind == "token":
                times.append(time.perf_counter() - start)
            elif line.startswith("data:") and kind == "done":
                ended = json.loads(line.partition(":")[2])
                if ended.get("status") != "succeeded":
                    raise RuntimeError(f"job {job_id} ended {ended}")
                return times
    raise RuntimeError(f"job {job_id}'s events ended before its done event")


def quote_figures(pairs: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """:class:`Quote` of ``(quoted, measured)`` milliseconds, one pair per request."""
    ratios = [measured / quoted for quoted, measured in pairs if quoted > 0]
    if not ratios:
        return None
    return {
        "quoted": len(ratios),
        "ratio_p10": round(quantile(ratios, 0.1), 3),
        "ratio_p50": round(quantile(ratios, 0.5), 3),
        "ratio_p90": round(quantile(ratios, 0.9), 3),
        "within_2x": round(sum(0.5 <= r <= 2.0 for r in ratios) / len(ratios), 3),
    }


def through_stack(
    stack: FerryUp, prompts: Sequence[tuple[Request, str]]
) -> tuple[dict[str, Any], dict[str, float] | None]:
    """Every request posted at once, each by a client thread that then streams its tokens:
    the run's figures, and how the 202s' quotes compared with the first tokens."""
    headers = {"Authorization": f"Bearer {stack.token}"}
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    records: list[Record] = []
    quotes: list[tuple[float, float]] = []  # (quoted, measured) ms
    lock = threading.Lock()
    with webclient.client(
        base_url=stack.base, headers=headers, limits=limits, timeout=60
    ) as client:
        start = time.perf_counter()

        def one(request: Request, text: str) -> None:
            body = {"prompt": text, "max_tokens": request.max_tokens, "temperature": 0}
            posted = time.perf_counter() - start
            answer = client.post("/v1/jobs", json={"model": MODEL, "input": body})
            if answer.status_code != 202:
                raise RuntimeError(f"submit failed: {answer.status_code} {answer.text}")
            accepted = answer.json()
            times = read_events(client, accepted["id"], start)
            if len(times) != request.max_tokens:
                raise RuntimeError(f"{len(times)} tokens streamed, asked for {request.max_tokens}")
            with lock:
                records.append(Record(posted, times[0], times[-1], len(times)))
                if accepted.get("estimated_wait_ms") is not None:
                    quotes.append((accepted["estimated_wait_ms"], (times[0] - posted) * 1000.0))

        with ThreadPoolExecutor(len(prompts)) as pool:
            for future in [pool.submit(one, r, text) for r, text in prompts]:
                future.result()
    return summary(records), quote_figures(quotes)


def warm(stack: FerryUp, prompts: Sequence[tuple[Request, str]]) -> None:
    """A few requests first: the worker has loaded its model, run its first steps and
    published what it learned from them (what the API quotes from)."""
    through_stack(stack, prompts[: min(4, len(prompts))])


def one_round(
    local: InProcess, stack: FerryUp, prompts: Sequence[tuple[Request, str]]
) -> dict[str, Any]:
    in_process = local.run([r for r, _ in prompts])  # alone first, then the stack, as always
    stacked, quote = through_stack(stack, prompts)
    found = {"in_process": in_process, "stack": stacked}
    for system, f in found.items():
        print(
            f"  {system:10} {f['tokens_per_s']:8.1f} tokens/s  TTFT p50 {f['ttft_p50_ms']:8.1f} "
            f"p99 {f['ttft_p99_ms']:8.1f} ms  TPOT p50 {f['tpot_p50_ms']:6.1f} "
            f"p99 {f['tpot_p99_ms']:6.1f} ms",
            flush=True,
        )
    if quote is not None:
        print(
            f"  quotes     {quote['quoted']} of {len(prompts)}: measured/quoted p10 "
            f"{quote['ratio_p10']:.2f} p50 {quote['ratio_p50']:.2f} p90 {quote['ratio_p90']:.2f}, "
            f"{quote['within_2x']:.0%} within 2x",
            flush=True,
        )
    return {**found, "quote": quote}


def figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median and range over the rounds, and the stack's share, round by round."""
    out: dict[str, Any] = {
        system: {f: results.spread([r[system][f] for r in rounds]) for f in FIGURES}
        for system in SYSTEMS
    }
    out["stack_share"] = ratio_spread(
        [r["stack"]["tokens_per_s"] for r in rounds],
        [r["in_process"]["tokens_per_s"] for r in rounds],
    )
    out["ttft_p50_added_ms"] = results.spread(
        [r["stack"]["ttft_p50_ms"] - r["in_process"]["ttft_p50_ms"] for r in rounds]
    )
    quoted = [r["quote"] for r in rounds if r.get("quote") is not None]
    out["quote"] = (
        {f: results.spread([q[f] for q in quoted]) for f in QUOTE_FIGURES} if quoted else None
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_options(parser)
    parser.add_argument("--kv-mib", type=float, default=256.0, help="the KV pool, both ways")
    parser.add_argument("--out", type=Path, default=Path("bench/results/generation_stack.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    smoke = args.smoke or os.environ.get(results.SMOKE_ENV) == "1"
    if smoke:
        args.rounds, args.requests = 1, min(args.requests, 8)
        args.layers, args.hidden, args.heads, args.kv_mib = 2, 128, 4, 16.0
    head = results.provenance("generation_stack", argv)
    head["smoke"] = smoke
    started = time.monotonic()
    prompt_lengths, output_lengths = (SMOKE_PROMPTS, SMOKE_OUTPUTS) if smoke else (PROMPTS, OUTPUTS)
    with tempfile.TemporaryDirectory(prefix="ferry-bench-lm-stack-") as tmp:
        model, context = build(args, Path(tmp))
        local = InProcess(model, args.threads)
        corpus_ids = corpus_tokens(local)
        drawn = draw_workload(corpus_ids, args.requests, args.seed, prompt_lengths, output_lengths)
        prompts = prompts_as_text(model.folder, drawn)
        stack = FerryUp(
            Path(tmp),
            celery=False,
            FERRY_MODEL_REPOSITORY=str(model.repository),
            FERRY_MODELS=MODEL,
            FERRY_FLOWER_PORT="0",
            FERRY_CPU_THREADS=str(args.threads),
            FERRY_DEVICE="cpu",
            **LIMITS,
        )
        settings = run_settings(args, smoke, context, local)
        workload = workload_facts([r for r, _ in prompts], prompt_lengths, output_lengths)
        rounds: list[dict[str, Any]] = []
        report: dict[str, Any] = {}
        try:
            stack.start()
            local.run([r for r, _ in prompts[:4]])
            warm(stack, prompts)
            for number in range(1, args.rounds + 1):
                print(f"round {number} of {args.rounds}", flush=True)
                rounds.append(one_round(local, stack, prompts))
                report = {"workload": workload, "rounds": rounds, **figures(rounds)}
                # Written after every round: a run cut short still leaves what it measured.
                results.write(args.out, report, settings=settings, head=head)
        finally:
            FerryUp.stop(stack.process, 60)
    report["seconds"] = round(time.monotonic() - started, 1)
    results.write(args.out, report, settings=settings, head=head)
    share = report["stack_share"]
    print(
        f"the stack's output tokens/s: {share['median']:.2f}x in-process "
        f"({share['min']:.2f}-{share['max']:.2f}); wrote {args.out} in {report['seconds']:.0f} s"
    )
    return 0


def corpus_tokens(local: InProcess) -> list[int]:
    from ferry.lm_build import corpus_text

    return list(local.runtime.runner.tokenizer.encode(corpus_text()).ids)


def model_settings(args: argparse.Namespace, context: int, local: InProcess) -> dict[str, Any]:
    """What a results file says of the model and of the engine's limits."""
    limits = local.runtime.limits
    return {
        "model": {
            "arch": "llama",
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "context_tokens": context,
        },
        "limits": {
            "max_running": limits.max_running,
            "step_tokens": limits.step_tokens,
            "prefill_chunk_tokens": limits.prefill_chunk_tokens,
            "kv_blocks": limits.kv_blocks,
            "block_size": limits.block_size,
        },
    }


def run_settings(
    args: argparse.Namespace, smoke: bool, context: int, local: InProcess
) -> dict[str, Any]:
    return {
        "smoke": smoke,
        **model_settings(args, context, local),
        "device": "cpu",
        "precision": "fp32",
        "threads": args.threads,
        "requests": args.requests,
        "rounds": args.rounds,
        "seed": args.seed,
        "eos": "none: every request generates exactly its max_tokens",
        "stack": "ferry up: its own Redis and SQLite, the API, one worker, no Flower",
    }


# --- its tables (python -m bench.render) --------------------------------------------------


def render_generation_stack(results: Results) -> list[str]:
    doc, report = results["generation_stack"], results.typed("generation_stack", Report)
    s, w = doc["settings"], report.workload
    m, limits = s["model"], s["limits"]
    names = {"in_process": "the engine in one process", "stack": "ferry up, over HTTP, streamed"}
    rows = []
    for system, name in names.items():
        f = {k: Figure.summary(v) for k, v in getattr(report, system).items()}
        rows.append(
            [name, f["tokens_per_s"].text(decimal(), system == "stack")]
            + [f[k].text(decimal(0, " ms")) for k in ("ttft_p50_ms", "ttft_p99_ms")]
            + [f[k].text(decimal(1, " ms")) for k in ("tpot_p50_ms", "tpot_p99_ms")]
        )
    share = Figure.summary(report.stack_share).text(percent())
    added = Figure.summary(report.ttft_p50_added_ms).text(decimal(0, " ms"))
    return [
        f"{measured_on(doc)}; median of "
        f"{counted(len(report.rounds), 'round', 'rounds')} (min–max), the two interleaved. A "
        f"{m['arch']}-shaped model of {m['layers']} layers, hidden {m['hidden']} (random "
        f"weights), {s['precision']} on `{s['device']}`, "
        f"{counted(s['threads'], 'torch thread', 'torch threads')} both ways; max_running "
        f"{limits['max_running']}, step_tokens {limits['step_tokens']}, prefill_chunk_tokens "
        f"{limits['prefill_chunk_tokens']}. {s['requests']} requests posted at once: prompts "
        f"{w.prompt_tokens.p50:g} tokens at the median, {w.prompt_tokens.max} at "
        f"most; outputs {w.output_tokens.p50:g} at the median, "
        f"{w.output_tokens.max} at most ({w.output_tokens.total:,} in all, no EOS). "
        "Through the stack each time is the client's: from its POST to each token event it "
        "read.",
        "",
        *table(["system", "output tokens/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"],
               "lrrrrr", rows),
        "",
        f"The stack's output tokens/s, round by round, are {share} of the engine's in one "
        f"process; its median time to first token is {added} longer.",
        *_quote_lines(report),
    ]  # fmt: skip


def _quote_lines(report: Report) -> list[str]:
    """How the 202's quote compared with the first token each client saw."""
    if report.quote is None:
        return []
    f = {k: Figure.summary(v) for k, v in report.quote.items()}
    ratio = decimal(2, "×")
    return [
        "",
        "Each 202's `estimated_wait_ms` (until the job's first token) against the time to "
        f"first token its client then saw, measured ÷ quoted: {f['ratio_p50'].text(ratio)} at "
        f"the median request, {f['ratio_p10'].text(ratio)} at the 10th percentile and "
        f"{f['ratio_p90'].text(ratio)} at the 90th; {f['within_2x'].text(percent())} of the "
        "requests within half to twice their quote.",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
