"""The minilm runtime on the CPU: reduced precision agrees with fp32; no CUDA machinery is made."""

from __future__ import annotations

from typing import Any

import pytest

from backends.catalog import cpu_threads
from bench.corpus import load_texts
from tests.models import runtime as shipped_runtime
from tests.vectors import cosine


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return load_texts(0, max_files=40)[:16]


@pytest.fixture(scope="module")
def reference(texts: list[str]) -> list[list[float]]:
    return shipped_runtime("minilm").run(texts)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_agrees_with_fp32(
    precision: str, texts: list[str], reference: list[list[float]]
) -> None:
    runtime: Any = shipped_runtime("minilm", precision=precision, warmup_batch=32)
    # On the CPU there is no stream, no device memory share and no pinned staging.
    assert (runtime._stream, runtime._memory, runtime.pinned_bytes) == (None, None, 0)
    outputs = runtime.run(texts)
    assert runtime.peak_memory_bytes is None
    agreement = [cosine(a, b) for a, b in zip(outputs, reference, strict=True)]
    assert min(agreement) >= 0.999, agreement
    assert outputs != reference  # it did compute in the lower precision


def test_the_three_stages_give_what_run_gives(
    texts: list[str], reference: list[list[float]]
) -> None:
    runtime = shipped_runtime("minilm")
    assert not runtime.asynchronous  # on the CPU a launch computes at once
    first = runtime.prepare(texts[:8])
    second = runtime.prepare(texts[8:])  # tokenised before the first is launched
    ids, mask, types = first.tensors
    assert ids.shape == mask.shape == types.shape and ids.shape[0] == 8
    launched = runtime.launch(first)
    assert launched.device_s > 0 and launched.peak_memory_bytes is None
    outputs = runtime.collect(launched) + runtime.collect(runtime.launch(second))
    assert min(cosine(a, b) for a, b in zip(outputs, reference, strict=True)) >= 0.99999


def test_a_model_on_the_cpu_computes_with_the_threads_it_is_given() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        shipped_runtime("minilm", cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cpu_threads_default_to_half_the_cores() -> None:
    assert [cpu_threads(0, cores) for cores in (1, 2, 3, 16)] == [1, 1, 1, 8]
    assert cpu_threads(3, 16) == 3  # a setting is taken as it is
