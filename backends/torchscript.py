"""The ``torchscript`` and ``torch-export`` backends: a saved torch module, tensors in and out.

``torchscript`` runs a file written by ``torch.jit.save`` (parameter ``file``,
default ``model.pt``); ``torch-export`` one written by ``torch.export.save``
(default ``model.pt2``), an ExportedProgram loaded with ``torch.export.load``.
Both take ``tensor`` inputs: each declared ``[[input.tensors]]`` is stacked
over the batch into one tensor of its dtype, and the module is called with
them positionally, in the order they are declared. ``file`` is relative to
the version's folder unless absolute.

The module returns a tensor, or a tuple, list or dict of tensors, each with
the batch on its first axis; each is cut into one value per input (nested
lists). A tensor gives an array per input; a tuple or list, a list of
arrays; a dict, an object of its members. Parameter ``outputs`` names a
tensor's or a tuple's members in order (an object per input then), or
chooses a dict's members and their order. Each input's outputs must keep
their shapes and dtypes from batch to batch.

An ExportedProgram must have been exported with its batch axis dynamic. In
torch 2.13 (the version this was written against) that is an example batch
of 2 or more and axis 0 of every input marked::

    batch = torch.export.Dim("batch")          # or torch.export.Dim.DYNAMIC
    program = torch.export.export(module.eval(), (x, ids),
                                  dynamic_shapes={"x": {0: batch}, "ids": {0: batch}})
    torch.export.save(program, "model.pt2")

Export refuses an example batch of 1 (it specialises sizes 0 and 1), and
without ``dynamic_shapes`` fixes the batch at the example's size: ``check``
(from the file's serialised graph, without torch) and ``load`` refuse such a
program. The program so exported runs batches of 1 too (this backend's tests
run 1, 3 and 7). An upper bound (``Dim("batch", max=n)``) must be at least
the largest batch the scheduler may send, or larger batches fail. Export the
module in eval mode: dropout and batch norm are fixed in the program when it
is exported, and a loaded program refuses ``eval()``.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from backends.base import RuntimeOptions, autocast, calibrated, parameter_problems
from backends.torch_runtime import PinnedStager, TorchRuntime, staged
from core.models.repository import ModelConfig, ModelVersion, Problem, TensorSpec

PARAMETERS: dict[str, type | tuple[type, ...]] = {"file": str, "outputs": list}
# Activations per input value, a deliberate over-estimate (about what
# ResNet-50 needs per value of its image) used where peak memory cannot be
# measured: a tensor model's layers are unknown to Ferry.
DECLARED_BYTES_PER_VALUE = 1024
# torch.export's serialised dtypes (torch/_export/serde/schema.py, ScalarType).
SERIALISED_DTYPES = {4: "int32", 5: "int64", 6: "float16", 7: "float32", 12: "bool", 13: "bfloat16"}


@dataclass(frozen=True)
class Format:
    """One of the two file formats: its backend's name and its default file."""

    backend: str
    default_file: str
    saved_by: str


TORCHSCRIPT = Format("torchscript", "model.pt", "torch.jit.save")
TORCH_EXPORT = Format("torch-export", "model.pt2", "torch.export.save")


def model_file(model: ModelConfig, version: ModelVersion, default: str) -> Path:
    value = model.parameters.get("file")
    path = Path(value if isinstance(value, str) and value else default).expanduser()
    return path if path.is_absolute() else version.files / path


def archive_kind(path: Path) -> str:
    """What wrote ``path``, from its zip archive's entries: jit, export, save, or ``""``."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return ""
    if any(name.split("/")[1:2] == ["archive_format"] for name in names):
        return "export"
    if any(name.split("/")[1:2] == ["code"] for name in names):
        return "jit"
    if any(name.endswith("/data.pkl") for name in names):
        return "save"
    return ""


def exported_inputs(path: Path) -> list[tuple[list[int | None], str | None]] | None:
    """Each user input's sizes (None: symbolic) and dtype, from a .pt2's serialised graph.

    None when the archive is not laid out as this version of torch writes it:
    ``load`` then checks the same with torch.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/models/model.json"))
            program = json.loads(archive.read(name))
        graph_module = program["graph_module"]
        values = graph_module["graph"]["tensor_values"]
        inputs: list[tuple[list[int | None], str | None]] = []
        for spec in graph_module["signature"]["input_specs"]:
            if "user_input" not in spec:
                continue
            argument = spec["user_input"]["arg"]
            if "as_tensor" not in argument:
                inputs.append(([], None))
                continue
            meta = values[argument["as_tensor"]["name"]]
            sizes = [size.get("as_int") for size in meta["sizes"]]
            inputs.append((sizes, SERIALISED_DTYPES.get(meta["dtype"], f"dtype {meta['dtype']}")))
        return inputs
    except (OSError, zipfile.BadZipFile, StopIteration, KeyError, TypeError, ValueError):
        return None


def signature_problems(
    declared: tuple[TensorSpec, ...], inputs: list[tuple[list[int | None], str | None]]
) -> list[tuple[str, str]]:
    """``(field, message)`` for each way an exported program's inputs differ from [input]."""
    if len(inputs) != len(declared):
        return [
            (
                "input.tensors",
                f"declares {len(declared)} tensors, but the exported program takes {len(inputs)}",
            )
        ]
    problems = []
    for i, (spec, (sizes, dtype)) in enumerate(zip(declared, inputs, strict=True)):
        where = f"input.tensors[{i}]"
        if dtype is None:
            problems.append((where, "the exported program takes a value here, not a tensor"))
            continue
        if not sizes or sizes[0] is not None:
            fixed = sizes[0] if sizes else "none"
            problems.append(
                (
                    where,
                    f"the exported program's batch axis for {spec.name!r} is fixed ({fixed}); "
                    "export it with dynamic_shapes marking axis 0 as torch.export.Dim('batch') "
                    "and an example batch of 2 or more",
                )
            )
        elif tuple(sizes[1:]) != spec.shape:
            shown = ["?" if s is None else s for s in sizes[1:]]
            problems.append(
                (where + ".shape", f"is {list(spec.shape)}; the exported program takes {shown}")
            )
        if dtype != spec.dtype:
            problems.append(
                (where + ".dtype", f"is {spec.dtype}; the exported program takes {dtype}")
            )
    return problems


class TorchModuleBackend:
    input_kinds = frozenset({"tensor"})
    uses_device = True

    def __init__(self, format: Format) -> None:
        self.format = format
        self.name = format.backend

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        # parameter_problems would call a list "list": this says what the list holds.
        problems = [
            p for p in parameter_problems(model, PARAMETERS) if p.field != "parameters.outputs"
        ]
        outputs = model.parameters.get("outputs")
        if "outputs" in model.parameters and (
            not isinstance(outputs, list)
            or not outputs
            or not all(isinstance(o, str) and o for o in outputs)
            or len(set(outputs)) != len(outputs)
        ):
            problems.append(
                Problem(
                    model.where(),
                    "parameters.outputs",
                    "must be an array of distinct output names (strings)",
                )
            )
        if model.input.kind != "tensor":
            problems.append(
                Problem(model.where(), "input.kind", f"{self.name} takes tensor inputs")
            )
            return problems
        path = model_file(model, version, self.format.default_file)
        field = "parameters.file" if "file" in model.parameters else ""
        where = model.where() if field else model.where(version.folder)
        if not path.is_file():
            problems.append(
                Problem(where, field, f"{path.name} is missing (looked in {path.parent})")
            )
            return problems
        kind = archive_kind(path)
        wanted = "jit" if self.format is TORCHSCRIPT else "export"
        if kind != wanted:
            other = {"jit": TORCHSCRIPT, "export": TORCH_EXPORT}.get(kind)
            if other is not None:
                hint = f"it was written by {other.saved_by}: backend = {other.backend!r}"
            elif kind == "save":
                hint = "it was written by torch.save (a state_dict or a pickled module)"
            else:
                hint = "it is not a torch archive"
            problems.append(
                Problem(
                    where,
                    field,
                    f"{path.name} is not a {self.format.saved_by} file ({hint})",
                )
            )
            return problems
        if self.format is TORCH_EXPORT:
            inputs = exported_inputs(path)
            if inputs is not None:
                problems += [
                    Problem(model.where(), key, message)
                    for key, message in signature_problems(model.input.tensors, inputs)
                ]
        return problems

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> TorchModuleRuntime:
        outputs = model.parameters.get("outputs")
        return TorchModuleRuntime(
            model.name,
            self.format,
            model_file(model, version, self.format.default_file),
            model.input.tensors,
            tuple(str(o) for o in outputs) if isinstance(outputs, list) else None,
            input_cost(model),
            options,
        )


def input_cost(model: ModelConfig) -> int:
    """One input's cost, as the API prices it (core.models.inputs.TensorInputSpec)."""
    if model.cost.function == "constant":
        return model.cost.value
    return sum(math.prod(spec.shape) for spec in model.input.tensors)


BACKENDS = {
    "torchscript": TorchModuleBackend(TORCHSCRIPT),
    "torch-export": TorchModuleBackend(TORCH_EXPORT),
}

# One output's layout: its name (None: a tuple's member, unnamed), per-input shape, dtype.
Part = tuple[str | None, tuple[int, ...], Any]


@dataclass(frozen=True)
class Layout:
    """What the module returns for each input: one tensor, a sequence, or named tensors."""

    parts: tuple[Part, ...]
    sequence: bool  # a tuple or list, unnamed: each output is a list

    def __str__(self) -> str:
        return ", ".join(
            f"{name or i}: {list(shape)} {str(dtype).removeprefix('torch.')}"
            for i, (name, shape, dtype) in enumerate(self.parts)
        )


@dataclass(eq=False)
class TorchModuleRuntime(TorchRuntime):
    padded = False  # every input of a tensor model has the same shape

    name: str
    format: Format
    path: Path
    tensors: tuple[TensorSpec, ...]
    output_names: tuple[str, ...] | None
    cost: int
    options: InitVar[RuntimeOptions]

    def __post_init__(self, options: RuntimeOptions) -> None:
        super().__init__(options)
        self.cost = max(self.cost, 1)
        # The outputs' layout, fixed by the first batch: on a GPU the launch
        # copies one tensor back, so several outputs travel packed in one.
        self._layout: Layout | None = None

    def load(self) -> None:
        import torch

        self._take_device()
        if self.format is TORCHSCRIPT:
            module = torch.jit.load(str(self.path), map_location=self.device).eval()
            held = [*module.parameters(), *module.buffers()]
        else:
            program = torch.export.load(str(self.path))
            problems = signature_problems(self.tensors, self._signature(program))
            if problems:
                raise ValueError(f"{self.path.name}: " + "; ".join(m for _, m in problems))
            if self.device != "cpu":
                from torch.export.passes import move_to_device_pass

                program = move_to_device_pass(program, self.device)
            held = [*program.state_dict.values(), *program.constants.values()]
            # Its mode was fixed when it was exported (eval() is refused): see above.
            module = program.module()
        self._weights_bytes = sum(
            t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor)
        )
        self._model = module
        blank = self._blank()
        self._warm_up(blank, blank)

    @staticmethod
    def _signature(program: Any) -> list[tuple[list[int | None], str | None]]:
        import torch

        user_inputs = set(program.graph_signature.user_inputs)
        inputs: list[tuple[list[int | None], str | None]] = []
        for node in program.graph.nodes:
            if node.op != "placeholder" or node.name not in user_inputs:
                continue
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                inputs.append(([], None))
                continue
            sizes: list[int | None] = [s if isinstance(s, int) else None for s in value.shape]
            inputs.append((sizes, str(value.dtype).removeprefix("torch.")))
        return inputs

    def _blank(self) -> Any:
        """An input of zeros (False for booleans), as the API would pass it."""
        import torch

        values = {
            spec.name: torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype)).tolist()
            for spec in self.tensors
        }
        return next(iter(values.values())) if len(values) == 1 else values

    def declared_memory(self) -> tuple[float, float]:
        values = sum(math.prod(spec.shape) for spec in self.tensors)
        # Per unit of cost: the scheduler multiplies by each input's cost.
        return float(self._weights_bytes), float(DECLARED_BYTES_PER_VALUE * values / self.cost)

    def calibrate(self) -> tuple[float, float, float] | None:
        """Time one input and a batch of 16, so the first estimates are measured, not guessed."""
        blank = self._blank()
        span_items = 16
        return calibrated(
            self.run, [blank], self.cost, [blank] * span_items, span_items * self.cost
        )

    def _host_inputs(self, inputs: list[Any], stager: PinnedStager | None) -> list[Any]:
        import torch

        batch = []
        for spec in self.tensors:
            if len(self.tensors) == 1:
                values = [item[spec.name] if isinstance(item, dict) else item for item in inputs]
            else:
                values = [item[spec.name] for item in inputs]
            tensor = torch.tensor(values, dtype=getattr(torch, spec.dtype))
            if tuple(tensor.shape[1:]) != spec.shape:
                raise ValueError(
                    f"input {spec.name!r} has shape {list(tensor.shape[1:])}, "
                    f"not {list(spec.shape)}"
                )
            batch.append(staged(stager, spec.name, tensor))
        return batch

    def _forward(self, *tensors: Any) -> Any:
        import torch

        with autocast(self.device, self.precision):
            result = self._model(*tensors)
        parts, sequence = self._parts(result)
        rows = tensors[0].shape[0]
        for name, tensor in parts:
            if tensor.dim() == 0 or tensor.shape[0] != rows:
                label = "the output" if name is None else f"output {name!r}"
                raise ValueError(
                    f"{label} has shape {list(tensor.shape)}: not one row per input ({rows})"
                )
        layout = Layout(tuple((n, tuple(t.shape[1:]), t.dtype) for n, t in parts), sequence)
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise ValueError(
                f"the outputs changed from ({self._layout}) to ({layout}); each input's "
                "outputs must have the same shapes and dtypes in every batch"
            )
        if len(parts) == 1:
            return parts[0][1]
        # Each output's rows as bytes, side by side: one tensor, whatever the dtypes.
        return torch.cat(
            [t.contiguous().reshape(rows, -1).view(torch.uint8) for _, t in parts], dim=1
        )

    def _parts(self, result: Any) -> tuple[list[tuple[str | None, Any]], bool]:
        """The module's outputs, named as parameter ``outputs`` or a dict names them.

        And whether they are an unnamed sequence (each input's outputs then a list).
        """
        import torch

        names = self.output_names
        if isinstance(result, torch.Tensor):
            parts: list[tuple[str | None, Any]] = [(None, result)]
        elif isinstance(result, tuple | list):
            parts = [(None, t) for t in result]
        elif isinstance(result, dict):
            if names is not None:
                missing = [n for n in names if n not in result]
                if missing:
                    raise ValueError(
                        f"the module returned no output {missing[0]!r} "
                        f"(it returned {', '.join(map(str, result))})"
                    )
                parts = [(n, result[n]) for n in names]
            else:
                parts = [(str(n), t) for n, t in result.items()]
        else:
            raise ValueError(
                f"the module returned {type(result).__name__}; a tensor, or a tuple, list "
                "or dict of tensors, is expected"
            )
        if not parts or not all(isinstance(t, torch.Tensor) for _, t in parts):
            raise ValueError("the module returned no tensor, or something that is not a tensor")
        if names is None or parts[0][0] is not None:
            return parts, isinstance(result, tuple | list)
        if len(names) != len(parts):
            raise ValueError(
                f"parameters.outputs names {len(names)} outputs; the module returned {len(parts)}"
            )
        return [(name, t) for name, (_, t) in zip(names, parts, strict=True)], False

    def _outputs(self, result: Any) -> list[Any]:
        import torch

        layout = self._layout
        if layout is None:
            raise RuntimeError("no batch has been computed")
        rows = result.shape[0]
        if len(layout.parts) == 1:
            columns = [result.tolist()]
        else:
            columns, start = [], 0
            for _, shape, dtype in layout.parts:
                width = math.prod(shape) * dtype.itemsize
                # A copy of its own: a slice of the bytes may not be aligned for ``dtype``.
                part = result[:, start : start + width].clone(memory_format=torch.contiguous_format)
                part = part.view(dtype)
                columns.append(part.reshape(rows, *shape).tolist())
                start += width
        names = [name for name, _, _ in layout.parts]
        if names[0] is not None:
            return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]
        if layout.sequence:
            return [list(row) for row in zip(*columns, strict=True)]
        return columns[0]
