"""The GPU execution layer on a real GPU: streams, overlap, out-of-memory, precision, memory.

Skipped without CUDA (see conftest.py).
"""

from __future__ import annotations

import bisect
import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from bench.corpus import load_texts
from workers.execute import run_isolating
from workers.runtimes.base import OutOfMemory
from workers.runtimes.minilm import MiniLMRuntime

DEVICE = "cuda:0"


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return load_texts(0, max_files=60)[:256]


@pytest.fixture(scope="module")
def runtime() -> MiniLMRuntime:
    loaded = MiniLMRuntime(DEVICE, 256, warmup_batch=64, memory_fraction=0.5)
    loaded.load()
    return loaded


def gpu_streams(work: Any, trace_path: Path) -> set[int]:
    """The CUDA streams the kernels and copies ``work()`` launches ran on (Kineto's ids)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work()
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    return {
        int(event["args"]["stream"])
        for event in events
        if event.get("cat") in ("kernel", "gpu_memcpy") and "stream" in event.get("args", {})
    }


def test_kernels_and_copies_run_on_the_models_stream_not_the_default_one(
    runtime: MiniLMRuntime, texts: list[str], tmp_path: Path
) -> None:
    import torch

    default = gpu_streams(
        lambda: (torch.ones(64, device=DEVICE) * 2).cpu(), tmp_path / "default.json"
    )
    assert default, "the profiler recorded no GPU work on the default stream"
    model = gpu_streams(lambda: runtime.run(texts[:32]), tmp_path / "model.json")
    assert model, "the profiler recorded no GPU work for the batch"
    assert not model & default, (model, default)
    assert len(model) == 1, model  # copies and kernels alike, on the one stream


def test_two_models_in_one_process_overlap(texts: list[str], tmp_path: Path) -> None:
    """Two runtimes, each on its stream, run from two threads: their kernels overlap in time."""
    from torch.profiler import ProfilerActivity, profile

    first = MiniLMRuntime(DEVICE, 256, memory_fraction=0.4)
    second = MiniLMRuntime(DEVICE, 256, memory_fraction=0.4)
    first.load()
    second.load()
    batch = texts[:128]

    def rounds(runtime: MiniLMRuntime) -> None:
        for _ in range(20):
            runtime.run(batch)

    threads = [threading.Thread(target=rounds, args=(r,)) for r in (first, second)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    path = tmp_path / "two.json"
    prof.export_chrome_trace(str(path))
    spans: dict[int, list[tuple[float, float]]] = {}
    for event in json.loads(path.read_text())["traceEvents"]:
        if event.get("cat") == "kernel" and "stream" in event.get("args", {}):
            start = float(event["ts"])
            spans.setdefault(int(event["args"]["stream"]), []).append(
                (start, start + float(event["dur"]))
            )
    assert len(spans) == 2, list(spans)  # one stream per model
    a, b = spans.values()
    b.sort()
    starts = [span[0] for span in b]
    overlapping = 0
    for start, end in a:
        # Any kernel of b that began before this one ended and ended after it began.
        at = bisect.bisect_left(starts, end)
        overlapping += any(b_end > start for _b_start, b_end in b[max(0, at - 50) : at])
    assert overlapping > 0, "the two models' kernels never ran at the same time"


def test_a_forced_out_of_memory_is_survived_by_splitting(texts: list[str]) -> None:
    import torch

    runtime = MiniLMRuntime(DEVICE, 256, memory_fraction=0.9)
    runtime.load()
    # Shrink the share to a little above what the weights and a small batch need.
    in_use = torch.cuda.memory_allocated(torch.device(DEVICE))
    total = torch.cuda.get_device_properties(torch.device(DEVICE)).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((in_use + 300 * 2**20) / total, torch.device(DEVICE))
    long_texts = [" ".join(["word"] * 250)] * 1024
    with pytest.raises(OutOfMemory):
        runtime.run(long_texts)
    ooms: list[tuple[int, int]] = []
    results = run_isolating(runtime.run, long_texts, on_oom=lambda s, e: ooms.append((s, e)))
    assert ooms, "the batch never ran out of memory"
    assert all(result.ok for result in results)
    assert len(results) == 1024
    torch.cuda.set_per_process_memory_fraction(0.9, torch.device(DEVICE))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_agrees_with_fp32_on_the_corpus(
    precision: str, runtime: MiniLMRuntime, texts: list[str]
) -> None:
    reduced = MiniLMRuntime(DEVICE, 256, precision=precision, memory_fraction=0.3)
    reduced.load()
    reference = runtime.run(texts)
    outputs = reduced.run(texts)
    assert min(cosine(a, b) for a, b in zip(outputs, reference, strict=True)) >= 0.999


def test_no_memory_growth_over_a_thousand_batches(runtime: MiniLMRuntime, texts: list[str]) -> None:
    import torch

    sizes = [1, 7, 32, 64, 3, 48]
    for number in range(50):  # the pool reaches its working size
        runtime.run(texts[: sizes[number % len(sizes)]])
    settled = torch.cuda.memory_allocated(torch.device(DEVICE))
    reserved = torch.cuda.memory_reserved(torch.device(DEVICE))
    staged = runtime._stager.bytes if runtime._stager is not None else 0
    for number in range(1000):
        runtime.run(texts[: sizes[number % len(sizes)]])
    assert torch.cuda.memory_allocated(torch.device(DEVICE)) <= settled
    assert torch.cuda.memory_reserved(torch.device(DEVICE)) <= reserved + 64 * 2**20
    assert (runtime._stager.bytes if runtime._stager is not None else 0) == staged


def test_the_peak_of_each_batch_is_measured(runtime: MiniLMRuntime, texts: list[str]) -> None:
    runtime.run(texts[:2])
    small: Any = runtime.peak_memory_bytes
    runtime.run(texts[:64])
    large: Any = runtime.peak_memory_bytes
    assert small is not None and large is not None and large > small
