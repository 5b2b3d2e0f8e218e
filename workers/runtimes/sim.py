"""The simulated accelerator: a batch takes ``base + per_cost x cost`` ms.

It sleeps rather than burning CPU, so batching behaviour can be measured on a
machine without a GPU, and it declares ``m0 + m1 x cost`` bytes of memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class SimulatedFailure(RuntimeError):
    pass


@dataclass
class SimRuntime:
    latency_base_ms: float
    latency_per_cost_ms: float
    memory_base_bytes: int
    memory_per_cost_bytes: int
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    name: str = "sim"
    device: str = "sim"

    def load(self) -> None:
        return None

    def latency_ms(self, batch_cost: int) -> float:
        return self.latency_base_ms + self.latency_per_cost_ms * batch_cost

    def memory_bytes(self, batch_cost: int) -> int:
        return self.memory_base_bytes + self.memory_per_cost_bytes * batch_cost

    def run(self, inputs: list[Any]) -> list[Any]:
        batch_cost = sum(int(item["cost"]) for item in inputs)
        self.sleep(self.latency_ms(batch_cost) / 1000.0)
        for position, item in enumerate(inputs):
            if item.get("fail"):
                raise SimulatedFailure(
                    f"simulated failure (input asked for it, batch position {position})"
                )
        return [{"cost": int(item["cost"])} for item in inputs]
