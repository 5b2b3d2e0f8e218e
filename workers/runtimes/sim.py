"""The simulated accelerator: a batch takes ``base + per_cost x cost`` ms.

It sleeps rather than burning CPU, so batching behaviour can be measured on a
machine without a GPU. It declares ``m0 + m1 x cost`` bytes of memory and,
when given a capacity, runs out of memory like a GPU above it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.runtimes.base import OutOfMemory

SIM_MEMORY_BUDGET_BYTES = 8 * 2**30
CRASH_EXIT_CODE = 70  # the simulated device's memory unless told otherwise


class SimulatedFailure(RuntimeError):
    pass


@dataclass
class SimRuntime:
    latency_base_ms: float
    latency_per_cost_ms: float
    memory_base_bytes: int
    memory_per_cost_bytes: int
    memory_capacity_bytes: int = 0  # 0: unlimited
    budget_bytes: int | None = None
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    name: str = "sim"
    device: str = "sim"
    padded: bool = False

    def load(self) -> None:
        return None

    def latency_ms(self, batch_cost: int) -> float:
        return self.latency_base_ms + self.latency_per_cost_ms * batch_cost

    def memory_bytes(self, batch_cost: int) -> int:
        return self.memory_base_bytes + self.memory_per_cost_bytes * batch_cost

    def declared_memory(self) -> tuple[float, float]:
        return float(self.memory_base_bytes), float(self.memory_per_cost_bytes)

    def memory_budget_bytes(self) -> float:
        return float(self.budget_bytes or SIM_MEMORY_BUDGET_BYTES)

    def calibrate(self) -> tuple[float, float, float] | None:
        # The simulated device's latency is known exactly: no need to measure.
        return self.latency_base_ms / 1000.0, self.latency_per_cost_ms / 1000.0, 1000.0

    @property
    def peak_memory_bytes(self) -> float | None:
        return None  # like a CPU: the declared estimate stands

    def run(self, inputs: list[Any]) -> list[Any]:
        batch_cost = sum(int(item["cost"]) for item in inputs)
        needed = self.memory_bytes(batch_cost)
        if self.memory_capacity_bytes and needed > self.memory_capacity_bytes:
            raise OutOfMemory(
                f"simulated out of memory: the batch needs {needed} bytes, "
                f"the device has {self.memory_capacity_bytes}"
            )
        if any(item.get("crash") for item in inputs):
            # Die as a segfault would: no cleanup, no acknowledgement.
            os._exit(CRASH_EXIT_CODE)
        self.sleep(self.latency_ms(batch_cost) / 1000.0)
        for position, item in enumerate(inputs):
            if item.get("fail"):
                raise SimulatedFailure(
                    f"simulated failure (input asked for it, batch position {position})"
                )
        return [{"cost": int(item["cost"])} for item in inputs]
