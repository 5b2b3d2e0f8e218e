"""The whole-stack generation benchmark's pure parts (bench/generation_stack.py): the model's
model.toml and the figures it reports."""

from __future__ import annotations

import tomllib
from pathlib import Path

from backends.generation import PARAMETERS
from bench.generation_stack import MODEL, Model, figures


def one_round(in_process: float, stack: float, ttft: tuple[float, float]) -> dict:
    def run(tokens_per_s: float, ttft_p50_ms: float) -> dict[str, float]:
        return {
            "tokens_per_s": tokens_per_s,
            "ttft_p50_ms": ttft_p50_ms,
            "ttft_p99_ms": 2 * ttft_p50_ms,
            "tpot_p50_ms": 10.0,
            "tpot_p99_ms": 20.0,
        }

    return {"in_process": run(in_process, ttft[0]), "stack": run(stack, ttft[1])}


def test_the_model_toml_names_the_backend_and_the_limits_both_ways_share(tmp_path: Path) -> None:
    model = Model(tmp_path, tmp_path / MODEL / "1", max_running=32, step_tokens=512,
                  prefill_chunk_tokens=256, kv_cache_bytes=2**28)  # fmt: skip
    parsed = tomllib.loads(model.toml(context_tokens=1024))
    assert parsed["name"] == MODEL and parsed["backend"] == "causal-lm"
    assert parsed["input"]["kind"] == "generation"
    assert parsed["input"]["context_tokens"] == 1024
    assert parsed["parameters"] == {
        "max_running": 32,
        "step_tokens": 512,
        "prefill_chunk_tokens": 256,
        "kv_cache_bytes": 2**28,
    }
    assert set(parsed["parameters"]) <= set(PARAMETERS)  # the backend reads every one


def test_the_stack_s_share_is_taken_round_by_round() -> None:
    rounds = [
        one_round(200.0, 180.0, (100.0, 150.0)),
        one_round(100.0, 80.0, (90.0, 170.0)),
        one_round(150.0, 135.0, (110.0, 140.0)),
    ]
    found = figures(rounds)
    # 0.9, 0.8 and 0.9: not the medians' ratio (135 / 150).
    assert found["stack_share"] == {"median": 0.9, "min": 0.8, "max": 0.9}
    assert found["in_process"]["tokens_per_s"]["median"] == 150.0
    assert found["stack"]["tokens_per_s"]["max"] == 180.0
    assert found["ttft_p50_added_ms"]["median"] == 50.0
    assert found["ttft_p50_added_ms"]["max"] == 80.0
