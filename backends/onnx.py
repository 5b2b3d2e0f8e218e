"""The ``onnx`` backend: an ONNX file run by ONNX Runtime, one output row per input.

The version's files hold the graph (``model.onnx``, or [parameters] ``file``)
and, for text models, the tokenizer.json that [input] ``tokenizer`` names.
The graph's first axis is the batch and must be dynamic.

* **text**: the batch is tokenised (truncated at ``input.max_tokens``, padded
  to its longest text) and fed as whichever of ``input_ids``,
  ``attention_mask`` and ``token_type_ids`` the graph declares (what
  ``python -m backends.onnx_export`` writes for a SentenceTransformer).
  An output whose second axis is the graph's sequence axis (a token-level
  output) is cut back to each text's own tokens.
* **tensor**: each [[input.tensors]] is stacked into one array of its dtype
  and fed by its name.

Each input's output is its row of the chosen output as a list, values as
ONNX Runtime gives them (float32 as Python floats, unrounded, as the
sentence-transformers backend returns them; integers as integers).

[parameters]: ``file``, ``providers`` (an execution provider or a list of
them), ``intra_op_threads`` (0 or unset: ONNX Runtime's default) and
``output`` (the output returned; default the graph's first).

Devices: on ``cpu`` only host providers run (a GPU provider listed is left
out, so a CPU worker never touches a GPU). On ``cuda:N`` the default is
the CUDA provider, then the CPU's for operators it lacks; GPU providers get
``device_id`` N, and the CUDA arena is capped at the worker's budget
(``budget_bytes``, else ``memory_fraction`` of the device's memory as torch
reports it; past it a batch raises :class:`OutOfMemory`, which the loop
answers with smaller batches) and grows by what is asked, not by doubling.
A CPU-only onnxruntime on a GPU machine runs the model on the CPU (logged;
the runtime's ``device`` then says ``cpu``). A GPU provider that is named but
missing, or that ONNX Runtime could not start (CUDA or cuDNN libraries not
found), is an error at load: ONNX Runtime itself would fall back to the CPU
and only log it. ``session.run`` copies inputs to the device and outputs
back, so a batch is synchronous (the loop overlaps only recording with it)
and its peak is not measured: the declared estimate stands. The graph's own
precision is used whatever ``precision`` says. (The CUDA path is written to
ONNX Runtime's documented provider options; Ferry's CI has no GPU build of
onnxruntime to run it.)

The API side imports neither onnxruntime nor torch; ``check`` reads the
graph's inputs and outputs with the ``onnx`` package when it is installed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.base import (
    HostRuntime,
    OutOfMemory,
    RuntimeOptions,
    calibrated,
    file_problems,
    parameter_problems,
)
from core.models.repository import ModelConfig, ModelVersion, Problem, TensorSpec

log = logging.getLogger(__name__)

DEFAULT_FILE = "model.onnx"
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# Where a tokenizers Encoding keeps each of them.
ENCODING_FIELDS = {
    "input_ids": "ids",
    "attention_mask": "attention_mask",
    "token_type_ids": "type_ids",
}
PARAMETERS: dict[str, type | tuple[type, ...]] = {
    "file": str,
    "providers": (str, list),
    "intra_op_threads": int,
    "output": str,
}
CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
# Providers that place work on a GPU: left out on a CPU device.
GPU_PROVIDERS = frozenset(
    {
        CUDA_PROVIDER,
        "TensorrtExecutionProvider",
        "ROCMExecutionProvider",
        "MIGraphXExecutionProvider",
        "DmlExecutionProvider",
    }
)
# Providers that take a device_id option (the N of cuda:N).
DEVICE_ID_PROVIDERS = frozenset({CUDA_PROVIDER, "TensorrtExecutionProvider"})
# numpy has no bfloat16, and ONNX Runtime's Python API takes numpy arrays.
TENSOR_DTYPES = ("float32", "float16", "int64", "int32", "bool")
# ONNX Runtime's type names, and onnx.TensorProto's element types, per dtype.
ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(bool)": "bool",
}
ONNX_ELEMENT_TYPES = {1: "float32", 10: "float16", 7: "int64", 6: "int32", 9: "bool"}

# Activations per padded token: the same deliberate over-estimate the
# sentence-transformers backend makes for a small encoder, used where peak
# memory cannot be measured (ONNX Runtime reports none).
DECLARED_BYTES_PER_TOKEN = 64 * 1024
# Activations per input value of a tensor model, the torchscript backend's
# over-estimate (about what ResNet-50 needs per value of its image): the
# graph's layers are unknown to Ferry.
DECLARED_BYTES_PER_VALUE = 1024
# ONNX Runtime's messages when an allocation fails (CPU arena or CUDA).
OUT_OF_MEMORY_MARKERS = ("failed to allocate memory", "out of memory", "bad_alloc")


class OnnxBackend:
    name = "onnx"
    input_kinds = frozenset({"text", "tensor"})
    uses_device = True

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        problems = parameter_problems(model, PARAMETERS)
        problems += _value_problems(model)
        config = model.input
        if config.kind not in self.input_kinds:
            problems.append(
                Problem(
                    model.where(),
                    "input.kind",
                    f"is {config.kind!r}; the onnx backend takes text or tensor inputs",
                )
            )
            return problems
        if config.kind == "text":
            if not config.tokenizer:
                problems.append(
                    Problem(
                        model.where(),
                        "input.tokenizer",
                        "is missing (the onnx backend tokenises text with a tokenizer.json)",
                    )
                )
            else:
                problems += file_problems(model, version, config.tokenizer)
        for i, spec in enumerate(config.tensors):
            if spec.dtype not in TENSOR_DTYPES:
                problems.append(
                    Problem(
                        model.where(),
                        f"input.tensors[{i}].dtype",
                        f"is {spec.dtype!r}; the onnx backend takes {', '.join(TENSOR_DTYPES)} "
                        "(cast inside the graph for another type)",
                    )
                )
        if any(p.field == "parameters.file" for p in problems):
            return problems
        path = graph_path(model, version)
        if not path.is_file():
            named = "file" in model.parameters
            problems.append(
                Problem(
                    model.where(version.folder),
                    "parameters.file" if named else "",
                    f"{path.name} is missing (onnx needs it; looked in {path.parent})",
                )
            )
            return problems
        return problems + _graph_problems(model, version, path)

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> OnnxRuntime:
        parameters = model.parameters
        providers = parameters.get("providers")
        config = model.input
        per_input = (
            model.cost.value
            if model.cost.function == "constant"
            else sum(math.prod(t.shape) for t in config.tensors)
        )
        return OnnxRuntime(
            model.name,
            graph_path(model, version),
            options,
            kind=config.kind,
            tokenizer=model.tokenizer_path(version.number),
            max_tokens=config.max_tokens or 512,
            tensors=config.tensors,
            cost_per_input=max(1, per_input),
            providers=[providers] if isinstance(providers, str) else providers,
            intra_op_threads=int(parameters.get("intra_op_threads", 0)),
            output=parameters.get("output"),
        )


BACKENDS = {"onnx": OnnxBackend()}


def graph_path(model: ModelConfig, version: ModelVersion) -> Path:
    """The ONNX file: [parameters] ``file`` (absolute, or in the version's files)."""
    return model.parameter_path("file", version.number) or version.files / DEFAULT_FILE


def _value_problems(model: ModelConfig) -> list[Problem]:
    """What parameter_problems cannot see: list items and ranges."""
    problems = []
    providers = model.parameters.get("providers")
    if isinstance(providers, list) and (
        not providers or not all(isinstance(p, str) and p for p in providers)
    ):
        problems.append(
            Problem(
                model.where(),
                "parameters.providers",
                "must be an execution provider's name or a list of them "
                '(["CUDAExecutionProvider", "CPUExecutionProvider"])',
            )
        )
    threads = model.parameters.get("intra_op_threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads < 0:
        problems.append(
            Problem(
                model.where(),
                "parameters.intra_op_threads",
                f"must be 0 (ONNX Runtime's default) or more, got {threads}",
            )
        )
    return problems


@dataclass(frozen=True)
class GraphIO:
    """A graph input or output: its name, per-axis sizes (str: symbolic) and dtype."""

    name: str
    shape: tuple[int | str | None, ...]
    dtype: str | None  # None: a type this backend does not feed


def read_graph(path: Path) -> tuple[list[GraphIO], list[GraphIO]]:
    """The graph's inputs (initializers left out) and outputs, read with the ``onnx`` package."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}

    def describe(value: Any) -> GraphIO:
        tensor = value.type.tensor_type
        shape: list[int | str | None] = []
        for dim in tensor.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(int(dim.dim_value))
            else:
                shape.append(dim.dim_param or None)
        return GraphIO(value.name, tuple(shape), ONNX_ELEMENT_TYPES.get(tensor.elem_type))

    inputs = [describe(v) for v in graph.input if v.name not in initializers]
    return inputs, [describe(v) for v in graph.output]


def _graph_problems(model: ModelConfig, version: ModelVersion, path: Path) -> list[Problem]:
    """The graph's inputs and outputs against [input] and [parameters] (when onnx is here)."""
    try:
        import onnx  # noqa: F401 (only to know whether the graph can be read here)
    except ImportError:
        return []
    where = model.where(version.folder)
    try:
        inputs, outputs = read_graph(path)
    except Exception as exc:
        first = (str(exc) or type(exc).__name__).splitlines()[0]
        return [Problem(where, "", f"{path.name} cannot be read as an ONNX model ({first})")]
    problems = [
        Problem(
            where,
            "",
            f"{path.name}: input {graph_input.name!r} has a fixed batch axis of "
            f"{graph_input.shape[0]} (export it with a dynamic first axis)",
        )
        for graph_input in inputs
        if graph_input.shape and isinstance(graph_input.shape[0], int)
    ]
    output = model.parameters.get("output")
    names = [o.name for o in outputs]
    if isinstance(output, str) and output not in names:
        problems.append(
            Problem(
                model.where(),
                "parameters.output",
                f"{output!r} is not an output of {path.name} ({', '.join(names) or 'none'})",
            )
        )
    if model.input.kind == "text":
        problems += _text_graph_problems(model, path.name, where, inputs)
    else:
        problems += _tensor_graph_problems(model, path.name, inputs)
    return problems


def _text_graph_problems(
    model: ModelConfig, file_name: str, where: str, inputs: list[GraphIO]
) -> list[Problem]:
    problems = []
    names = {i.name for i in inputs}
    if "input_ids" not in names:
        problems.append(
            Problem(where, "", f"{file_name} has no input named input_ids (text models need one)")
        )
    for graph_input in inputs:
        if graph_input.name not in TEXT_INPUTS:
            problems.append(
                Problem(
                    where,
                    "",
                    f"{file_name} takes input {graph_input.name!r}; a text model's inputs are "
                    f"among {', '.join(TEXT_INPUTS)}",
                )
            )
        elif graph_input.dtype not in ("int64", "int32"):
            problems.append(
                Problem(
                    where, "", f"{file_name}: input {graph_input.name!r} must be int64 or int32"
                )
            )
    return problems


def _tensor_graph_problems(
    model: ModelConfig, file_name: str, inputs: list[GraphIO]
) -> list[Problem]:
    problems = []
    by_name = {i.name: i for i in inputs}
    declared = {t.name for t in model.input.tensors}
    for i, spec in enumerate(model.input.tensors):
        graph_input = by_name.get(spec.name)
        field = f"input.tensors[{i}]"
        if graph_input is None:
            problems.append(
                Problem(
                    model.where(),
                    f"{field}.name",
                    f"{spec.name!r} is not an input of {file_name} "
                    f"({', '.join(sorted(by_name)) or 'none'})",
                )
            )
            continue
        if graph_input.dtype != spec.dtype:
            problems.append(
                Problem(
                    model.where(),
                    f"{field}.dtype",
                    f"is {spec.dtype!r}, but {file_name} takes "
                    f"{graph_input.dtype or 'another type'} for {spec.name!r}",
                )
            )
        if graph_input.shape and len(graph_input.shape) != len(spec.shape) + 1:
            problems.append(
                Problem(
                    model.where(),
                    f"{field}.shape",
                    f"has {len(spec.shape)} axes; {file_name} takes {len(graph_input.shape) - 1} "
                    f"after the batch axis for {spec.name!r}",
                )
            )
        elif graph_input.shape:
            for axis, (want, size) in enumerate(
                zip(spec.shape, graph_input.shape[1:], strict=True)
            ):
                if isinstance(size, int) and size != want:
                    problems.append(
                        Problem(
                            model.where(),
                            f"{field}.shape",
                            f"axis {axis} is {want}; {file_name} takes {size} for {spec.name!r}",
                        )
                    )
    for name in sorted(set(by_name) - declared):
        problems.append(
            Problem(
                model.where(),
                "input.tensors",
                f"does not declare {name!r}, an input {file_name} needs",
            )
        )
    return problems


def session_providers(
    device: str,
    requested: Sequence[str] | None,
    available: Sequence[str],
    budget_bytes: int | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """The providers (with their options) a session on ``device`` is made with.

    On a CPU device, GPU providers are left out. On ``cuda:N``, the default
    is the CUDA provider when this onnxruntime has it (else the CPU, logged);
    GPU providers get ``device_id`` N, the CUDA arena a cap at the budget.
    A provider named in [parameters] that this onnxruntime lacks is an error,
    rather than the silent fallback ONNX Runtime would make.
    """
    on_gpu = device.startswith("cuda")
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise RuntimeError(
                f"execution provider {', '.join(missing)} is not in this onnxruntime "
                f"(it has {', '.join(available)}; onnxruntime-gpu brings CUDA's)"
            )
        names = list(requested)
    elif on_gpu and CUDA_PROVIDER in available:
        names = [CUDA_PROVIDER, CPU_PROVIDER]
    else:
        if on_gpu:
            log.warning(
                "onnxruntime has no CUDA provider: the model runs on the CPU",
                extra={"device": device},
            )
        names = [CPU_PROVIDER]
    if not on_gpu:
        names = [name for name in names if name not in GPU_PROVIDERS] or [CPU_PROVIDER]
    index = device.partition(":")[2] or "0"
    chosen: list[tuple[str, dict[str, Any]]] = []
    for name in names:
        provider_options: dict[str, Any] = {}
        if on_gpu and name in DEVICE_ID_PROVIDERS:
            provider_options["device_id"] = int(index)
        if on_gpu and name == CUDA_PROVIDER:
            # Grow by what a batch asks, not by doubling past the budget.
            provider_options["arena_extend_strategy"] = "kSameAsRequested"
            if budget_bytes:
                provider_options["gpu_mem_limit"] = int(budget_bytes)
        chosen.append((name, provider_options))
    return chosen


@dataclass
class Prepared:
    """A batch ready for ``session.run``: the feed, and each input's token count (text)."""

    feed: dict[str, Any]
    size: int
    lengths: list[int] | None = None


class OnnxRuntime(HostRuntime):
    """One ONNX Runtime session; ``prepare`` tokenises or stacks, ``launch`` runs it."""

    def __init__(
        self,
        name: str,
        path: Path,
        options: RuntimeOptions,
        *,
        kind: str,
        tokenizer: Path | None = None,
        max_tokens: int = 512,
        tensors: tuple[TensorSpec, ...] = (),
        cost_per_input: int = 1,
        providers: Sequence[str] | None = None,
        intra_op_threads: int = 0,
        output: str | None = None,
    ) -> None:
        if kind not in OnnxBackend.input_kinds:
            raise ValueError(f"the onnx backend takes text or tensor inputs, not {kind!r}")
        self.name = name
        self.path = path
        self.device = options.device
        self.options = options
        self.budget_bytes = options.budget_bytes
        self.kind = kind
        self.padded = kind == "text"  # a text batch is padded to its longest text
        self.tokenizer_file = tokenizer
        self.max_tokens = max_tokens
        self.tensors = tensors
        self.cost_per_input = cost_per_input
        self.providers = list(providers) if providers else None
        # The model's own setting, else FERRY_CPU_THREADS on the CPU.
        self.intra_op_threads = intra_op_threads or (
            0 if options.device.startswith("cuda") else options.cpu_threads
        )
        self.output = output
        self._session: Any = None
        self._tokenizer: Any = None
        self._feeds: dict[str, str] = {}  # graph input -> numpy dtype
        self._token_level = False  # the output's second axis is the sequence
        self._device_budget: float | None = None

    def load(self) -> None:
        import onnxruntime as ort

        if self.options.precision != "fp32":
            log.info(
                "an ONNX graph runs in its own precision",
                extra={"model": self.name, "precision": self.options.precision},
            )
        on_cuda = self.device.startswith("cuda")
        if on_cuda:
            self._device_budget = _device_budget(self.device, self.options.memory_fraction)
        budget = self.budget_bytes or self._device_budget
        chosen = session_providers(
            self.device,
            self.providers,
            ort.get_available_providers(),
            int(budget) if on_cuda and budget else None,
        )
        settings = ort.SessionOptions()
        if self.intra_op_threads:
            settings.intra_op_num_threads = self.intra_op_threads
        session = ort.InferenceSession(
            str(self.path),
            sess_options=settings,
            providers=[name for name, _ in chosen],
            provider_options=[values for _, values in chosen],
        )
        running = session.get_providers()
        lost = [name for name, _ in chosen if name in GPU_PROVIDERS and name not in running]
        if lost:
            raise RuntimeError(
                f"onnxruntime could not start {', '.join(lost)} on {self.device} "
                "(its log says why: CUDA or cuDNN libraries not found, or another device)"
            )
        if on_cuda and not any(name in GPU_PROVIDERS for name in running):
            # Computed on the host after all (a CPU-only onnxruntime): say so.
            self.device, self._device_budget = "cpu", None
        self._session = session
        self._bind(session)
        if self.kind == "text":
            self._tokenizer = self._load_tokenizer()
        self._warm_up()

    def _bind(self, session: Any) -> None:
        """Which graph inputs are fed, in which dtype; which output is returned."""
        inputs = {i.name: i for i in session.get_inputs()}
        if self.kind == "text":
            wanted = [name for name in TEXT_INPUTS if name in inputs]
            unknown = sorted(set(inputs) - set(TEXT_INPUTS))
            if "input_ids" not in inputs or unknown:
                raise RuntimeError(
                    f"{self.path.name} takes {', '.join(sorted(inputs))}; a text model takes "
                    f"input_ids and optionally attention_mask and token_type_ids"
                )
        else:
            wanted = [t.name for t in self.tensors]
            missing = sorted(set(wanted) - set(inputs))
            extra = sorted(set(inputs) - set(wanted))
            if missing or extra:
                raise RuntimeError(
                    f"{self.path.name} takes {', '.join(sorted(inputs))}; "
                    f"[input.tensors] declares {', '.join(wanted)}"
                )
        self._feeds = {}
        for name in wanted:
            dtype = ORT_TYPES.get(inputs[name].type)
            declared = {t.name: t.dtype for t in self.tensors}.get(name)
            if dtype is None or (declared is not None and declared != dtype):
                raise RuntimeError(
                    f"{self.path.name}: input {name!r} is {inputs[name].type}"
                    + (f", declared {declared}" if declared else "")
                )
            self._feeds[name] = dtype
        outputs = session.get_outputs()
        names = [o.name for o in outputs]
        if self.output is None:
            self.output = names[0]
        elif self.output not in names:
            raise RuntimeError(f"{self.output!r} is not an output of {self.path.name} ({names})")
        shape = outputs[names.index(self.output)].shape
        ids_shape = inputs["input_ids"].shape if "input_ids" in inputs else []
        self._token_level = (
            self.kind == "text"
            and len(shape) >= 2
            and len(ids_shape) >= 2
            and isinstance(shape[1], str)
            and shape[1] == ids_shape[1]
        )

    def _load_tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        if self.tokenizer_file is None:
            raise RuntimeError("a text model needs input.tokenizer (a tokenizer.json)")
        tokenizer = Tokenizer.from_file(str(self.tokenizer_file))
        tokenizer.enable_truncation(max_length=self.max_tokens)
        padding = tokenizer.padding
        if padding:
            pad_id, pad_token = padding["pad_id"], padding["pad_token"]
        else:
            pad_token = next(
                (t for t in ("[PAD]", "<pad>") if tokenizer.token_to_id(t) is not None), "[PAD]"
            )
            pad_id = tokenizer.token_to_id(pad_token) or 0
        # To the batch's longest text, whatever fixed length the file may set.
        tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token)
        return tokenizer

    def _warm_up(self) -> None:
        """Pay for ONNX Runtime's lazy set-up now; on a GPU, grow the arena to the largest batch."""
        self.run([self._example(small=True)])
        if self.device.startswith("cuda") and self.options.warmup_batch > 1:
            self.run([self._example(small=False)] * self.options.warmup_batch)

    def _example(self, small: bool) -> Any:
        if self.kind == "text":
            return "a short sentence" if small else " ".join(["word"] * self.max_tokens)
        values = {t.name: _zeros(t.shape, t.dtype) for t in self.tensors}
        return next(iter(values.values())) if len(values) == 1 else values

    # The three stages (HostRuntime: launch computes, collect returns).

    def prepare_inputs(self, inputs: list[Any]) -> Prepared:
        import numpy as np

        if self._session is None:
            raise RuntimeError("model not loaded")
        if self.kind == "text":
            encodings = self._tokenizer.encode_batch([str(text) for text in inputs])
            feed = {
                name: np.array([getattr(e, ENCODING_FIELDS[name]) for e in encodings], dtype=dtype)
                for name, dtype in self._feeds.items()
            }
            lengths = [sum(e.attention_mask) for e in encodings]
            return Prepared(feed, len(inputs), lengths)
        feed = {}
        single = len(self.tensors) == 1
        for spec in self.tensors:
            values = [item if single else item[spec.name] for item in inputs]
            array = np.asarray(values, dtype=self._feeds[spec.name])
            if array.shape != (len(inputs), *spec.shape):
                raise ValueError(
                    f"{spec.name}: expected items of shape {list(spec.shape)}, "
                    f"got a batch of shape {list(array.shape)}"
                )
            feed[spec.name] = array
        return Prepared(feed, len(inputs))

    def compute(self, prepared: Prepared) -> list[Any]:
        try:
            (result,) = self._session.run([self.output], prepared.feed)
        except Exception as exc:
            message = str(exc)
            if any(marker in message.lower() for marker in OUT_OF_MEMORY_MARKERS):
                raise OutOfMemory(message.splitlines()[0]) from exc
            raise
        if result.ndim == 0 or result.shape[0] != prepared.size:
            raise RuntimeError(
                f"{self.output!r} has shape {list(result.shape)}, not one row per input "
                f"({prepared.size})"
            )
        if self._token_level and prepared.lengths is not None:
            return [
                row[:length].tolist() for row, length in zip(result, prepared.lengths, strict=True)
            ]
        return list(result.tolist())

    # Memory and timing.

    def declared_memory(self) -> tuple[float, float]:
        weights = float(_file_bytes(self.path))
        if self.kind == "text":
            return weights, float(DECLARED_BYTES_PER_TOKEN)
        values = sum(math.prod(t.shape) for t in self.tensors)
        # Per unit of cost: the scheduler multiplies by each input's cost.
        return weights, float(DECLARED_BYTES_PER_VALUE * values / self.cost_per_input)

    def memory_budget_bytes(self) -> float:
        if self.budget_bytes:
            return float(self.budget_bytes)
        if self._device_budget is not None:
            return self._device_budget
        return float(self.cpu_budget_bytes)

    def calibrate(self) -> tuple[float, float, float] | None:
        """Time a small and a large batch, so the first estimates are measured, not guessed."""
        span_items = 16
        small_input = self._example(small=True)
        large_input = self._example(small=False)
        if self.kind == "text":
            small_work = len(self._tokenizer.encode(small_input).ids)
            span = span_items * self.max_tokens
        else:
            small_work = self.cost_per_input
            span = span_items * self.cost_per_input
        return calibrated(self.run, [small_input], small_work, [large_input] * span_items, span)


def _zeros(shape: tuple[int, ...], dtype: str) -> Any:
    value: Any = False if dtype == "bool" else 0
    for size in reversed(shape):
        value = [value] * size
    return value


def _file_bytes(path: Path) -> int:
    """The graph's size on disk, with its external data beside it (``model.onnx.data``)."""
    if not path.is_file():
        return 0
    siblings = path.parent.glob(f"{path.name}*")
    return sum(p.stat().st_size for p in siblings if p.is_file())


def _device_budget(device: str, fraction: float) -> float | None:
    """The worker's share of the GPU's memory, when torch can say how much there is."""
    try:
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    except Exception:  # no torch, or no CUDA build: the CPU's default budget stands
        return None
    return float(total) * fraction
