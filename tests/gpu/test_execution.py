"""The GPU execution layer on a real GPU: streams, overlap, out-of-memory, precision, memory.

Skipped without CUDA (see conftest.py).
"""

from __future__ import annotations

import base64
import bisect
import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from backends.base import OutOfMemory
from backends.sentence_transformers import SentenceTransformerRuntime as MiniLMRuntime
from backends.torchvision import TorchvisionRuntime as ResNet50Runtime
from bench.corpus import load_texts
from tests.models import runtime as shipped_runtime
from tests.vectors import cosine
from workers.gpu.execute import run_isolating

DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return load_texts(0, max_files=60)[:256]


def minilm(**options: Any) -> Any:
    """The shipped minilm on the GPU, loaded (FERRY_MODEL_REPOSITORY may hold a copy)."""
    return shipped_runtime("minilm", DEVICE, **options)


@pytest.fixture(scope="module")
def runtime() -> MiniLMRuntime:
    loaded = minilm(warmup_batch=64, memory_fraction=0.5)
    return loaded


def gpu_streams(work: Any, trace_path: Path) -> set[int]:
    """The CUDA streams the kernels and copies ``work()`` launches ran on (Kineto's ids)."""
    from torch.profiler import ProfilerActivity, profile

    # One cycle: acc_events only silences the warning that events of earlier cycles are cleared.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
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

    first = minilm(memory_fraction=0.4)
    second = minilm(memory_fraction=0.4)
    second.load()
    batch = texts[:128]

    def rounds(runtime: MiniLMRuntime) -> None:
        for _ in range(20):
            runtime.run(batch)

    threads = [threading.Thread(target=rounds, args=(r,)) for r in (first, second)]
    # One cycle: acc_events only silences the warning that events of earlier cycles are cleared.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
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

    runtime = minilm(memory_fraction=0.9)
    # Shrink the share to a little above what the weights and a small batch need.
    in_use = torch.cuda.memory_allocated(torch.device(DEVICE))
    total = torch.cuda.get_device_properties(torch.device(DEVICE)).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((in_use + 300 * 2**20) / total, torch.device(DEVICE))
    long_texts = [" ".join(["word"] * 250)] * 1024
    with pytest.raises(OutOfMemory):
        runtime.run(long_texts)
    # The failed batch's activations were given back, not kept by its error's traceback.
    assert torch.cuda.memory_allocated(torch.device(DEVICE)) < in_use + 16 * 2**20
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
    reduced = minilm(precision=precision, memory_fraction=0.3)
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
    staged = runtime.pinned_bytes
    for number in range(1000):
        runtime.run(texts[: sizes[number % len(sizes)]])
    assert torch.cuda.memory_allocated(torch.device(DEVICE)) <= settled
    assert torch.cuda.memory_reserved(torch.device(DEVICE)) <= reserved + 64 * 2**20
    assert runtime.pinned_bytes == staged


def test_the_peak_of_each_batch_is_measured(runtime: MiniLMRuntime, texts: list[str]) -> None:
    runtime.run(texts[:2])
    small: Any = runtime.peak_memory_bytes
    runtime.run(texts[:64])
    large: Any = runtime.peak_memory_bytes
    assert small is not None and large is not None and large > small


@pytest.fixture(scope="module")
def resnet() -> ResNet50Runtime:
    loaded: Any = shipped_runtime(
        "resnet50", DEVICE, overrides={"random_weights": True}, precision="fp16",
        warmup_batch=32, memory_fraction=0.3,
    )  # fmt: skip
    return loaded


def jpegs(count: int) -> list[str]:
    from PIL import Image

    encoded = []
    for number in range(count):
        buffer = io.BytesIO()
        colour = (number * 37 % 256, number * 91 % 256, number * 13 % 256)
        Image.new("RGB", (320 + number, 240), colour).save(buffer, format="JPEG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode())
    return encoded


def test_resnet50_runs_in_channels_last_on_its_own_stream(
    resnet: ResNet50Runtime, tmp_path: Path
) -> None:
    import torch

    default = gpu_streams(
        lambda: (torch.ones(64, device=DEVICE) * 2).cpu(), tmp_path / "default.json"
    )
    model = gpu_streams(lambda: resnet.run(jpegs(16)), tmp_path / "resnet.json")
    assert model and not model & default, (model, default)
    assert len(model) == 1, model
    conv = resnet._model.conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("model", ["minilm", "resnet50"])
def test_a_batch_staged_while_another_computes_keeps_its_own_buffers(
    model: str, runtime: MiniLMRuntime, resnet: ResNet50Runtime, texts: list[str]
) -> None:
    """Batch B is staged while A computes, and A is read only after B is done too.

    Were the two to share a pinned buffer, A would read B's inputs or outputs.
    """
    loaded: Any = runtime if model == "minilm" else resnet
    inputs = texts[:64] if model == "minilm" else jpegs(48)
    first, second = inputs[: len(inputs) // 2], inputs[len(inputs) // 2 :]
    alone = [loaded.run(first), loaded.run(second)]
    launched = loaded.launch(loaded.prepare(first))
    staged = loaded.prepare(second)  # while the first computes
    launched.wait()
    following = loaded.launch(staged)
    following.wait()
    ahead = [loaded.collect(launched), loaded.collect(following)]
    assert launched.device_s > 0 and following.device_s > 0
    for got, expected in zip(ahead, alone, strict=True):
        if model == "minilm":
            assert min(cosine(a, b) for a, b in zip(got, expected, strict=True)) >= 0.9999
        else:
            for a, b in zip(got, expected, strict=True):
                assert [e["class"] for e in a["top5"]] == [e["class"] for e in b["top5"]]
                assert [e["score"] for e in a["top5"]] == pytest.approx(
                    [e["score"] for e in b["top5"]], abs=1e-2
                )


def test_each_batch_launched_ahead_has_its_own_peak(
    runtime: MiniLMRuntime, texts: list[str]
) -> None:
    runtime.run(texts[:2])
    small_alone: Any = runtime.peak_memory_bytes
    launched = runtime.launch(runtime.prepare(texts[:2]))
    staged = runtime.prepare(texts[:128])
    launched.wait()
    following = runtime.launch(staged)
    following.wait()
    runtime.collect(launched)
    runtime.collect(following)
    assert launched.peak_memory_bytes is not None and following.peak_memory_bytes is not None
    assert launched.peak_memory_bytes == pytest.approx(small_alone, rel=0.05)
    assert following.peak_memory_bytes > launched.peak_memory_bytes


def test_preparing_ahead_leaves_the_gpu_less_idle(runtime: MiniLMRuntime, texts: list[str]) -> None:
    """The same batches one after the other, then each prepared while the last computes."""
    import time

    batches = [texts[i : i + 64] for i in range(0, 256, 64)] * 8

    def plain() -> float:
        busy, started = 0.0, time.perf_counter()
        for batch in batches:
            launched = runtime.launch(runtime.prepare(batch))
            runtime.collect(launched)
            busy += launched.device_s
        return 1.0 - busy / (time.perf_counter() - started)

    def ahead() -> float:
        busy, started = 0.0, time.perf_counter()
        launched = runtime.launch(runtime.prepare(batches[0]))
        for batch in [*batches[1:], None]:
            staged = runtime.prepare(batch) if batch is not None else None
            launched.wait()
            busy += launched.device_s
            following = runtime.launch(staged) if staged is not None else None
            runtime.collect(launched)
            if following is None:
                break
            launched = following
        return 1.0 - busy / (time.perf_counter() - started)

    plain(), ahead()  # warm
    idle_plain, idle_ahead = plain(), ahead()
    print(f"GPU idle: one after the other {idle_plain:.1%}, prepared ahead {idle_ahead:.1%}")
    assert idle_ahead < idle_plain
