"""Run a batch so that every input gets exactly one outcome.

A batch that raises is bisected until the failing inputs are isolated: only
they fail (with the model's error), the others succeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
) -> list[ItemResult]:
    if not inputs:
        return []
    started = clock()
    try:
        outputs = run(inputs)
        if len(outputs) != len(inputs):
            raise RuntimeError(f"model returned {len(outputs)} outputs for {len(inputs)} inputs")
    except Exception as exc:
        if len(inputs) == 1:
            return [ItemResult(ok=False, error=_describe(exc), inference_ms=_ms(clock, started))]
        log.warning(
            "batch raised; bisecting",
            extra={"size": len(inputs), "error_type": type(exc).__name__},
        )
        middle = len(inputs) // 2
        return run_isolating(run, inputs[:middle], clock) + run_isolating(
            run, inputs[middle:], clock
        )
    elapsed = _ms(clock, started)
    return [ItemResult(ok=True, output=output, inference_ms=elapsed) for output in outputs]


def _ms(clock: Callable[[], float], started: float) -> float:
    return (clock() - started) * 1000.0


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or "no message"
    return f"{type(exc).__name__}: {text}"[:2000]
