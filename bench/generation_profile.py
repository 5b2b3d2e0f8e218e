"""Where a Ferry generation step's milliseconds go, measured on one offline run.

Timers around the parts of a step, all on ``time.perf_counter``:

* ``step``: ``GenerationEngine.step``, whole;
* ``scheduler``: the step less the runtime's ``execute`` (``schedule``,
  ``update_from_output``, the engine's bookkeeping);
* ``runtime_outside_forward``: ``execute`` less the model's forward (block
  tables and slots, the packed tensors, sampling, detokenizing);
* ``forward_outside_attention``: the library's layers (embeddings, norms,
  MLPs, the head), the forward less Ferry's attention function;
* ``attention_outside_sdpa``: Ferry's paged attention less the SDPA calls
  (the KV writes into the pool, each sequence's gathers and masks, the
  per-sequence loop itself);
* ``sdpa``: the library's SDPA, called once per sequence per layer.

The attention function is wrapped through the library's attention registry
for this one run (each layer looks it up at every call), the SDPA function in
the module Ferry's attention imports it from; both are put back after.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bench.generation_workload import Request


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        return timed


@contextmanager
def timed_attention(attention: Timer, sdpa: Timer) -> Iterator[None]:
    import transformers.integrations.sdpa_attention as sdpa_module
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from backends.generation import paged

    original_sdpa = sdpa_module.sdpa_attention_forward
    sdpa_module.sdpa_attention_forward = sdpa.wrap(original_sdpa)
    ALL_ATTENTION_FUNCTIONS[paged.ATTENTION] = attention.wrap(paged.paged_attention)
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS[paged.ATTENTION]
        sdpa_module.sdpa_attention_forward = original_sdpa


def profile(runtime: Any, requests: Sequence[Request]) -> dict[str, Any]:
    """One Ferry run of ``requests`` with every part of its steps timed."""
    from bench.generation_runs import run_ferry

    model = runtime.runner.model
    forward = Timer()
    started: list[float] = []

    def before(*_: Any) -> None:
        started.append(time.perf_counter())

    def after(*_: Any) -> None:
        forward.seconds += time.perf_counter() - started.pop()
        forward.calls += 1

    hooks = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    attention, sdpa = Timer(), Timer()
    try:
        with timed_attention(attention, sdpa):
            run = run_ferry(runtime.runner, runtime.limits, requests)
    finally:
        for hook in hooks:
            hook.remove()
    steps = len(run.step_s)
    step_s, execute_s = sum(run.step_s), sum(run.execute_s)
    parts_s = {
        "scheduler": step_s - execute_s,
        "runtime_outside_forward": execute_s - forward.seconds,
        "forward_outside_attention": forward.seconds - attention.seconds,
        "attention_outside_sdpa": attention.seconds - sdpa.seconds,
        "sdpa": sdpa.seconds,
    }
    layers = int(model.config.num_hidden_layers)
    return {
        "steps": steps,
        "per_step_ms": {
            "step": round(1000.0 * step_s / steps, 3),
            **{name: round(1000.0 * s / steps, 3) for name, s in parts_s.items()},
        },
        "share_of_step": {name: round(s / step_s, 4) for name, s in parts_s.items()},
        "tokens_per_step_mean": round(sum(run.step_tokens) / steps, 2),
        "sequences_per_step_mean": round(sdpa.calls / max(1, forward.calls) / layers, 2),
        "sdpa_calls_per_step": round(sdpa.calls / steps, 1),
        "us_per_sdpa_call": round(1e6 * sdpa.seconds / max(1, sdpa.calls), 2),
        "us_per_attention_call_per_sequence": round(
            1e6 * attention.seconds / max(1, sdpa.calls), 2
        ),
    }
