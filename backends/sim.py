"""The ``sim`` backend, a simulated accelerator: a batch takes ``base + per_cost x cost`` ms.

For measuring batching, and for capacity planning, on a machine without a
GPU: a model of this backend declares its device's latency and memory in
[parameters] and takes JSON inputs priced by a member (``{"cost": n}``).

Like a GPU it computes asynchronously: ``launch`` queues a batch behind the
ones before it and returns at once; ``collect`` waits until it is done. It
sleeps rather than burning CPU, so batching behaviour can be measured on a
machine without a GPU. It declares ``m0 + m1 x cost`` bytes of memory and,
when given a capacity, runs out of memory like a GPU above it.

With ``witness_dir`` set (the fault suite sets it; off by default), it is a
witness of its own computations, independent of the worker's bookkeeping:
each output carries a fresh random ``nonce``, and each collected batch is
appended, before its outputs are returned, as one JSON line to
``<witness_dir>/sim.<pid>.jsonl``: the process, the batch's number among the
ones it computed, its wall time and each input's ``tag`` (an identifier the
caller chose) with the nonce of its output. A job computed twice is two lines
with two nonces, whatever the worker later writes; the stored output's nonce
names the computation whose result was written.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.base import OutOfMemory, RuntimeOptions, parameter_problems
from core.models.repository import InputConfig, ModelConfig, ModelVersion, Problem

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
    prepare_ms_per_item: float = 0.0  # the CPU's work per input before a launch
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    name: str = "sim"
    # Only where the model enables it (the API refuses the member otherwise).
    crash_enabled: bool = True
    device: str = "sim"
    padded: bool = False
    # Like a GPU's stream: a launched batch computes while the worker goes on.
    asynchronous: bool = True
    # Where each computation is witnessed (None: nowhere, and outputs carry no nonce).
    witness_dir: Path | None = None
    # When the last batch launched is done (the device's queue drains then).
    _free_at: float = field(default=0.0, init=False, repr=False)
    _witnessed: int = field(default=0, init=False, repr=False)

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
        return self.collect(self.launch(self.prepare(inputs)))

    def prepare(self, inputs: list[Any]) -> list[Any]:
        """The CPU's share: busy work, holding the GIL as Python preprocessing does."""
        until = time.perf_counter() + self.prepare_ms_per_item * len(inputs) / 1000.0
        while time.perf_counter() < until:
            pass
        return list(inputs)

    def launch(self, prepared: list[Any]) -> SimLaunched:
        """Queue the batch on the simulated device: it starts once the one before is done."""
        batch_cost = sum(int(item["cost"]) for item in prepared)
        needed = self.memory_bytes(batch_cost)
        if self.memory_capacity_bytes and needed > self.memory_capacity_bytes:
            raise OutOfMemory(
                f"simulated out of memory: the batch needs {needed} bytes, "
                f"the device has {self.memory_capacity_bytes}"
            )
        if self.crash_enabled and any(item.get("crash") for item in prepared):
            # Die as a segfault would: no cleanup, no acknowledgement.
            os._exit(CRASH_EXIT_CODE)
        device_s = self.latency_ms(batch_cost) / 1000.0
        self._free_at = max(self.clock(), self._free_at) + device_s
        return SimLaunched(prepared, self._free_at, device_s, self)

    def collect(self, launched: SimLaunched) -> list[Any]:
        launched.wait()
        for position, item in enumerate(launched.inputs):
            if item.get("fail"):
                raise SimulatedFailure(
                    f"simulated failure (input asked for it, batch position {position})"
                )
        outputs = [{"cost": int(item["cost"])} for item in launched.inputs]
        if self.witness_dir is not None:
            self._witness(self.witness_dir, launched.inputs, outputs)
        return outputs

    def _witness(self, directory: Path, inputs: list[Any], outputs: list[dict[str, Any]]) -> None:
        """Give each output a nonce and append the batch to this process's witness file.

        One ``write`` of one line to a file of this process's own, opened to
        append: a kill leaves at most a last line without its newline, which
        :func:`read_witness` skips (its outputs were never returned).
        """
        for output in outputs:
            output["nonce"] = secrets.token_hex(8)
        self._witnessed += 1
        pid = os.getpid()
        items = [[item.get("tag"), out["nonce"]] for item, out in zip(inputs, outputs, strict=True)]
        line = json.dumps(
            {"pid": pid, "seq": self._witnessed, "at": time.time(), "items": items},
            separators=(",", ":"),
        )
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"sim.{pid}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            data = (line + "\n").encode()
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)


@dataclass
class SimLaunched:
    """A batch on the simulated device, done at ``ready_at`` (the runtime's clock)."""

    inputs: list[Any]
    ready_at: float
    device_s: float
    runtime: SimRuntime
    peak_memory_bytes: float | None = None  # like a CPU: the declared estimate stands

    def wait(self) -> None:
        left = self.ready_at - self.runtime.clock()
        if left > 0:
            self.runtime.sleep(left)

    def done(self) -> bool:
        return self.runtime.clock() >= self.ready_at


PARAMETERS: dict[str, type | tuple[type, ...]] = {
    "latency_base_ms": (int, float),
    "latency_per_cost_ms": (int, float),
    "memory_base_bytes": int,
    "memory_per_cost_bytes": int,
    # Raise a simulated out-of-memory error above this much memory (0: never).
    "memory_capacity_bytes": int,
    # CPU time spent preparing each input (busy work, as a tokeniser's).
    "prepare_ms_per_item": (int, float),
    # Inputs may ask to kill the worker running them ({"crash": true}): fault tests only.
    "crash_enabled": bool,
    # Inputs may ask to fail ({"fail": true}).
    "fail_enabled": bool,
    # Witness every computation in this folder ("": never): fault tests only.
    "witness_dir": str,
}


class SimBackend:
    name = "sim"
    input_kinds = frozenset({"json"})
    uses_device = False

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        problems = parameter_problems(model, PARAMETERS)
        for key in PARAMETERS:
            value = model.parameters.get(key, 0)
            if not isinstance(value, bool) and isinstance(value, int | float) and value < 0:
                file = model.where()
                problems.append(Problem(file, f"parameters.{key}", "must not be negative"))
        if model.cost.function != "field":
            file = model.where()
            problems.append(
                Problem(file, "cost.function", "sim prices inputs by a member: function = 'field'")
            )
        return problems

    def input_config(self, model: ModelConfig) -> InputConfig:
        """The model's schema, with the ``crash`` and ``fail`` members only where enabled."""
        schema = dict(model.input.schema or {})
        properties = dict(schema.get("properties", {}))
        for member, key in (("crash", "crash_enabled"), ("fail", "fail_enabled")):
            if not model.parameters.get(key, member == "fail"):
                properties.pop(member, None)
        schema["properties"] = properties
        return InputConfig(kind="json", schema=schema)

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> SimRuntime:
        p = model.parameters
        return SimRuntime(
            latency_base_ms=float(p.get("latency_base_ms", 20.0)),
            latency_per_cost_ms=float(p.get("latency_per_cost_ms", 0.5)),
            memory_base_bytes=int(p.get("memory_base_bytes", 64 * 2**20)),
            memory_per_cost_bytes=int(p.get("memory_per_cost_bytes", 2**20)),
            memory_capacity_bytes=int(p.get("memory_capacity_bytes", 0)),
            prepare_ms_per_item=float(p.get("prepare_ms_per_item", 0.0)),
            budget_bytes=options.budget_bytes,
            name=model.name,
            crash_enabled=bool(p.get("crash_enabled", False)),
            witness_dir=Path(p["witness_dir"]) if p.get("witness_dir") else None,
        )


BACKENDS = {"sim": SimBackend()}


@dataclass(frozen=True)
class Witnessed:
    """One batch the sim computed, as its witness file has it."""

    pid: int
    seq: int  # the batch's number among the ones this process computed, from 1
    at: float  # wall time, when it was computed
    items: tuple[tuple[str | None, str], ...]  # (the input's tag, the output's nonce)


def read_witness(directory: Path) -> list[Witnessed]:
    """Every batch witnessed under ``directory``, file by file, each in the order written."""
    found: list[Witnessed] = []
    for path in sorted(directory.glob("sim.*.jsonl")):
        for line in path.read_text().splitlines(keepends=True):
            if not line.endswith("\n"):
                break  # cut short by a kill: its outputs were never returned
            record = json.loads(line)
            items = tuple((tag, str(nonce)) for tag, nonce in record["items"])
            found.append(Witnessed(int(record["pid"]), int(record["seq"]), record["at"], items))
    return found
