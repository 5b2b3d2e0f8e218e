"""Run a batch so that every input gets exactly one outcome.

A batch that raises is bisected until the failing inputs are isolated: only
they fail (with the model's error), the others succeed. A batch that runs out
of memory is halved until the halves fit: nobody fails for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.base import OutOfMemory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemResult:
    ok: bool
    output: Any = None
    error: str | None = None
    inference_ms: float = 0.0


def run_isolating(
    run: Callable[[list[Any]], list[Any]],
    inputs: list[Any],
    clock: Callable[[], float] = time.perf_counter,
    on_oom: Callable[[int, int], None] | None = None,
    failed: Exception | None = None,
) -> list[ItemResult]:
    """Run ``inputs``; an out-of-memory halves the batch, any other error bisects it.

    ``on_oom(start, end)`` is told which slice of ``inputs`` ran out of memory,
    so the caller can learn from it. ``failed``: the whole batch already ran
    and raised this (so it is not run whole again).
    """
    if failed is not None:
        # Its traceback holds the frames of the attempt that raised it, and on
        # a GPU they hold what that attempt computed: dropped, so that the
        # retries find the memory free. The error's type and text remain.
        failed = failed.with_traceback(None)
    return _run_slice(run, inputs, 0, len(inputs), clock, on_oom, failed)


def check_outputs(outputs: list[Any], inputs: list[Any]) -> list[Any]:
    """``outputs``, when there is one per input (a model's bug otherwise)."""
    if len(outputs) != len(inputs):
        raise RuntimeError(f"model returned {len(outputs)} outputs for {len(inputs)} inputs")
    return outputs


def _run_slice(
    run: Callable[[list[Any]], list[Any]],
    inputs: list[Any],
    start: int,
    end: int,
    clock: Callable[[], float],
    on_oom: Callable[[int, int], None] | None,
    failed: Exception | None = None,
) -> list[ItemResult]:
    if start >= end:
        return []
    batch = inputs[start:end]
    started = clock()
    try:
        if failed is not None:
            raise failed
        outputs = check_outputs(run(batch), batch)
    except Exception as exc:
        out_of_memory = isinstance(exc, OutOfMemory)
        error = _describe(exc)
        error_type = type(exc).__name__
    else:
        elapsed = _ms(clock, started)
        return [ItemResult(ok=True, output=output, inference_ms=elapsed) for output in outputs]
    # Out of the except block: the error, its traceback and the frames it holds
    # (on a GPU, the failed attempt's activations) are gone before the halves
    # run, else they would run in the memory the failed batch still held.
    del failed
    if out_of_memory and on_oom is not None:
        on_oom(start, end)
    if len(batch) == 1:
        if out_of_memory:
            error = f"{error} (even alone: the input is too large for this device)"
        return [ItemResult(ok=False, error=error, inference_ms=_ms(clock, started))]
    log.warning(
        "batch out of memory; splitting" if out_of_memory else "batch raised; bisecting",
        extra={"size": len(batch), "error_type": error_type},
    )
    middle = (start + end) // 2
    return _run_slice(run, inputs, start, middle, clock, on_oom) + _run_slice(
        run, inputs, middle, end, clock, on_oom
    )


def _ms(clock: Callable[[], float], started: float) -> float:
    return (clock() - started) * 1000.0


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or "no message"
    return f"{type(exc).__name__}: {text}"[:2000]
