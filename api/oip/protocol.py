"""The Open Inference Protocol (KServe v2, as Triton speaks it): tensors in, jobs, tensors out.

The protocol names a model's inputs and outputs as tensors, each with a
datatype and a shape whose first dimension is the batch. Ferry's jobs take
one input each, so a request's tensors are cut into rows, one job a row,
and the rows' outputs are stacked back into tensors:

- a ``text`` model takes one ``BYTES`` tensor ``text`` of shape ``[N]`` or
  ``[N, 1]`` (UTF-8 strings); an ``image`` model one ``BYTES`` tensor
  ``image`` (the encoded files), or a ``UINT8`` one of shape ``[N, L]`` (each
  row a file of ``L`` bytes, as Triton's image pipelines send them); a
  ``json`` model one ``BYTES`` tensor ``input`` (a JSON document an
  element); a ``tensor`` model its declared tensors, with the batch dimension
  in front of each declared shape;
- a model that makes embeddings answers one ``FP32`` tensor ``embedding`` of
  shape ``[N, dimensions]``; any other answers ``BYTES`` ``output``, each
  element the job's output as JSON text.

Tensors travel as JSON (``data``, row-major, nested or flat) or in the
binary tensor data extension: the body is the JSON header, its length in the
``Inference-Header-Content-Length`` header, then each binary tensor's bytes
in order (``parameters.binary_data_size``); ``BYTES`` elements are each a
4-byte little-endian length and the bytes, numbers are little-endian.

This module is the protocol's pure part (parsing, checking, encoding); the
routes are ``api.oip.routes``.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from api.jobs.schemas import MAX_DEADLINE_MS
from api.openai.embeddings import as_vector
from core.db.versions import VersionState
from core.models.catalog import ModelSpec, text_problem
from scheduler.vocabulary import Lane

# Numeric datatypes and their struct codes (little-endian in the binary extension).
NUMERIC = {
    "BOOL": "?",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
DATATYPES = frozenset({*NUMERIC, "BYTES"})
# A tensor model's declared dtypes (model.toml) as the protocol's datatypes.
FROM_DTYPE = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}
# The largest finite value of the narrower float datatypes: a JSON number past it would
# become infinite on the way to the model.
FLOAT_MAX = {"FP16": 65504.0, "FP32": 3.4028234663852886e38}
HEADER_LENGTH = "Inference-Header-Content-Length"
# Triton's priority parameter: 1 is the highest, 0 the model's default.
LANES_BY_PRIORITY = {1: Lane.URGENT, 2: Lane.VIP, 3: Lane.NORMAL}
# What a one-tensor input kind calls its tensor.
TENSOR_NAMES = {"text": "text", "image": "image", "json": "input"}


class ProtocolError(ValueError):
    """A request the protocol refuses: 400 unless ``status`` says otherwise."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as a model's metadata declares it; -1 is a dimension of any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class Tensor:
    """A tensor of a request or a response: its elements flat, in row-major order.

    ``BYTES`` elements are ``bytes``; numeric ones Python numbers.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: list[Any] = field(default_factory=list)


def model_inputs(spec: ModelSpec) -> list[TensorSpec]:
    """``spec``'s inputs as tensors (ProtocolError for a kind the protocol does not serve)."""
    kind = spec.input.kind
    if kind in TENSOR_NAMES:
        return [TensorSpec(TENSOR_NAMES[kind], "BYTES", (-1,))]
    if kind == "tensor":
        return [
            TensorSpec(t.name, FROM_DTYPE.get(t.dtype, "FP32"), (-1, *t.shape))
            for t in spec.input.tensors
        ]
    raise ProtocolError(
        f"model {spec.name!r} generates text: it is served on /v1/completions and "
        "/v1/chat/completions, not by the inference protocol"
    )


def model_outputs(spec: ModelSpec) -> list[TensorSpec]:
    if spec.embeddings is not None:
        return [TensorSpec("embedding", "FP32", (-1, spec.embeddings.dimensions))]
    return [TensorSpec("output", "BYTES", (-1,))]


def model_metadata(spec: ModelSpec, versions: Sequence[int]) -> dict[str, Any]:
    return {
        "name": spec.name,
        "versions": [str(v) for v in versions],
        "platform": f"ferry_{spec.backend.replace('-', '_')}",
        "inputs": [t.metadata() for t in model_inputs(spec)],
        "outputs": [t.metadata() for t in model_outputs(spec)],
    }


@dataclass(frozen=True)
class InferRequest:
    """A parsed infer request: its id, parameters, input tensors and the outputs asked for."""

    id: str | None
    parameters: dict[str, Any]
    inputs: list[Tensor]
    # Each output asked for, and whether it is wanted in binary; None: all, in JSON
    # unless the request's binary_data_output says otherwise.
    outputs: dict[str, bool] | None

    def binary(self, name: str) -> bool:
        if self.outputs is not None and name in self.outputs:
            return self.outputs[name]
        return bool(self.parameters.get("binary_data_output", False))


def parse_request(body: bytes, header_length: str | None) -> InferRequest:
    """The request's JSON header and binary tensors; ProtocolError naming what is wrong."""
    length = len(body)
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise ProtocolError(f"{HEADER_LENGTH} must be an integer") from None
        if not 0 < length <= len(body):
            raise ProtocolError(
                f"{HEADER_LENGTH}: {length} is not within the body's {len(body)} bytes"
            )
    try:
        header = json.loads(body[:length])
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("the request's header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("the request must be a JSON object")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError("id must be a string")
    if request_id is not None and (problem := text_problem(request_id)):
        raise ProtocolError(f"id must not contain {problem}")
    parameters = _parameters(header.get("parameters"), "parameters")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("inputs must be a non-empty array of tensors")
    binary = memoryview(body)[length:]
    inputs = []
    for index, raw in enumerate(raw_inputs):
        tensor, used = _input(raw, f"inputs[{index}]", binary)
        binary = binary[used:]
        inputs.append(tensor)
    if len(binary):
        raise ProtocolError(f"{len(binary)} bytes of binary data follow the last tensor's")
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise ProtocolError("inputs: each tensor may be given once")
    return InferRequest(request_id, parameters, inputs, _outputs(header.get("outputs")))


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be an object")
    return value


def _outputs(value: Any) -> dict[str, bool] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ProtocolError("outputs must be an array")
    wanted = {}
    for index, raw in enumerate(value):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ProtocolError(f"outputs[{index}] must be an object with a name")
        parameters = _parameters(raw.get("parameters"), f"outputs[{index}].parameters")
        wanted[raw["name"]] = bool(parameters.get("binary_data", False))
    return wanted


def _input(raw: Any, where: str, binary: memoryview) -> tuple[Tensor, int]:
    """One input tensor and how many bytes of the binary part it took."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where} must be an object")
    name, datatype, shape, where, count = described(
        raw.get("name"), raw.get("datatype"), raw.get("shape"), where
    )
    parameters = _parameters(raw.get("parameters"), f"{where}.parameters")
    size = parameters.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size > len(binary):
            raise ProtocolError(f"{where}: binary_data_size {size!r} is more than the body holds")
        if "data" in raw:
            raise ProtocolError(f"{where}: data and binary_data_size both given")
        data = from_binary(bytes(binary[:size]), datatype, count, where)
        return Tensor(name, datatype, tuple(shape), data), size
    if "data" not in raw:
        raise ProtocolError(f"{where}: no data (nor binary_data_size)")
    data = _flat(raw["data"], datatype, where)
    if len(data) != count:
        raise ProtocolError(f"{where}: shape {shape} holds {count} elements, data has {len(data)}")
    return Tensor(name, datatype, tuple(shape), data), 0


def described(
    name: Any, datatype: Any, shape: Any, where: str
) -> tuple[str, str, list[int], str, int]:
    """An input tensor's name, datatype and shape, checked; then how errors name it from
    now on, and how many elements its shape holds."""
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where}.name must be a non-empty string")
    where = f"input {name!r}"
    if datatype not in DATATYPES:
        raise ProtocolError(f"{where}: datatype {datatype!r} is not one of the protocol's")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"{where}: shape must be a non-empty array of sizes (0 or more)")
    return name, datatype, shape, where, math.prod(shape)


def _flat(data: Any, datatype: str, where: str) -> list[Any]:
    """JSON ``data`` (nested arrays or flat) as flat elements of the datatype."""
    flat: list[Any] = []
    stack = [data]
    while stack:  # depth-first, right to left popped: row-major order kept by reversing
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            flat.append(element(item, datatype, where))
    return flat


def element(item: Any, datatype: str, where: str) -> Any:
    if datatype == "BYTES":
        if not isinstance(item, str):
            raise ProtocolError(f"{where}: a BYTES element in JSON must be a string")
        return item.encode()
    if datatype == "BOOL":
        if not isinstance(item, bool):
            raise ProtocolError(f"{where}: BOOL elements must be true or false")
        return item
    if isinstance(item, bool) or not isinstance(item, int | float):
        raise ProtocolError(f"{where}: {datatype} elements must be numbers")
    if datatype.startswith(("INT", "UINT")):
        if not isinstance(item, int):
            raise ProtocolError(f"{where}: {datatype} elements must be integers")
        low, high = _integer_range(datatype)
        if not low <= item <= high:
            raise ProtocolError(f"{where}: {item} is outside {datatype}'s range ({low} to {high})")
        return item
    if isinstance(item, float) and not math.isfinite(item):
        raise ProtocolError(f"{where}: elements must be finite")
    if abs(item) > FLOAT_MAX.get(datatype, math.inf):
        raise ProtocolError(f"{where}: {item} is beyond {datatype}'s range")
    return item


def _integer_range(datatype: str) -> tuple[int, int]:
    bits = 8 * struct.calcsize(NUMERIC[datatype])
    if datatype.startswith("U"):
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def from_binary(raw: bytes, datatype: str, count: int, where: str) -> list[Any]:
    if datatype == "BYTES":
        items, at = [], 0
        while at < len(raw):
            if at + 4 > len(raw):
                raise ProtocolError(f"{where}: a BYTES element's length is cut off")
            (size,) = struct.unpack_from("<I", raw, at)
            if at + 4 + size > len(raw):
                raise ProtocolError(f"{where}: a BYTES element is longer than its data")
            items.append(raw[at + 4 : at + 4 + size])
            at += 4 + size
        if len(items) != count:
            raise ProtocolError(f"{where}: shape holds {count} elements, data has {len(items)}")
        return items
    code = NUMERIC[datatype]
    if len(raw) != count * struct.calcsize(code):
        raise ProtocolError(
            f"{where}: {count} {datatype} elements are {count * struct.calcsize(code)} bytes, "
            f"got {len(raw)}"
        )
    values = list(struct.unpack(f"<{count}{code}", raw))
    if datatype.startswith("FP") and not all(math.isfinite(v) for v in values):
        raise ProtocolError(f"{where}: elements must be finite")
    return values


def rows(spec: ModelSpec, inputs: list[Tensor], max_rows: int) -> list[Any]:
    """The request's tensors cut into job inputs, one a row of the batch dimension."""
    declared = {t.name: t for t in model_inputs(spec)}
    given = {t.name: t for t in inputs}
    for name in given:
        if name not in declared:
            raise ProtocolError(
                f"input {name!r}: model {spec.name!r} has no such input "
                f"(its inputs: {', '.join(declared)})"
            )
    for name in declared:
        if name not in given:
            raise ProtocolError(f"input {name!r} is missing")
    kind = spec.input.kind
    counts = set()
    for name, tensor in given.items():
        want = declared[name]
        if kind == "image" and tensor.datatype == "UINT8":
            if len(tensor.shape) != 2:
                raise ProtocolError(
                    f"input {name!r}: shape {list(tensor.shape)}; a UINT8 image tensor is "
                    "[N, L], each row a file of L bytes"
                )
            counts.add(tensor.shape[0])
            continue
        if tensor.datatype != want.datatype:
            also = " (or UINT8 [N, L])" if kind == "image" else ""
            raise ProtocolError(
                f"input {name!r}: datatype {tensor.datatype}, the model takes {want.datatype}{also}"
            )
        per_row = want.shape[1:]
        got = tensor.shape[1:]
        fits = got == per_row or (not per_row and got in ((), (1,)))
        if not fits:
            expected = "[N] or [N, 1]" if not per_row else str([-1, *per_row])
            raise ProtocolError(
                f"input {name!r}: shape {list(tensor.shape)}, the model takes {expected}"
            )
        counts.add(tensor.shape[0])
    if len(counts) != 1:
        raise ProtocolError("inputs: every tensor must have the same first dimension (the batch)")
    (count,) = counts
    if count == 0:
        raise ProtocolError("inputs: the batch dimension is 0: there is nothing to run")
    if count > max_rows:
        raise ProtocolError(f"inputs: {count} rows; at most {max_rows} in one request")
    if kind in TENSOR_NAMES:
        (tensor,) = given.values()
        return [_job_input(kind, element, index) for index, element in enumerate(_elements(tensor))]
    per_tensor = {
        name: _split(given[name].data, count, declared[name].shape[1:]) for name in declared
    }
    if len(declared) == 1:
        (only,) = per_tensor.values()
        return only
    return [{name: per_tensor[name][i] for name in declared} for i in range(count)]


def _elements(tensor: Tensor) -> list[bytes]:
    """A one-tensor input's elements: BYTES as they are, a UINT8 [N, L] tensor's rows as
    bytes (Triton's image pipelines send each file so)."""
    if tensor.datatype != "UINT8":
        return list(tensor.data)
    width = tensor.shape[1]
    return [bytes(tensor.data[i * width : (i + 1) * width]) for i in range(tensor.shape[0])]


def _job_input(kind: str, element: bytes, index: int) -> Any:
    if kind == "image":
        return base64.b64encode(element).decode("ascii")
    try:
        text = element.decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"row {index}: not UTF-8 text") from None
    if kind == "json":
        try:
            return json.loads(text)
        except ValueError:
            raise ProtocolError(f"row {index}: not a JSON document") from None
    return text


def _split(flat: list[Any], count: int, shape: tuple[int, ...]) -> list[Any]:
    """``flat`` as ``count`` nested lists of ``shape``."""
    size = math.prod(shape)
    return [_nest(flat[i * size : (i + 1) * size], shape) for i in range(count)]


def _nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return list(flat)
    step = math.prod(shape[1:])
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def lane_and_deadline(parameters: dict[str, Any]) -> tuple[Lane | None, int | None]:
    """Triton's ``priority`` (1 highest; 0 the default) and ``timeout`` (µs) as Ferry's."""
    priority = parameters.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
        raise ProtocolError("parameters.priority must be an integer, 0 or more")
    lane = None if priority == 0 else LANES_BY_PRIORITY.get(priority, Lane.BULK)
    timeout = parameters.get("timeout")
    if timeout is None:
        return lane, None
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
        raise ProtocolError("parameters.timeout must be a positive integer (microseconds)")
    if timeout > MAX_DEADLINE_MS * 1000:
        raise ProtocolError(
            f"parameters.timeout: at most {MAX_DEADLINE_MS * 1000} µs (Ferry's longest deadline)"
        )
    return lane, max(1, math.ceil(timeout / 1000))


def output_tensors(spec: ModelSpec, outputs: list[Any]) -> list[Tensor]:
    """The jobs' outputs, in row order, stacked as the model's output tensors."""
    (declared,) = model_outputs(spec)
    if declared.datatype == "FP32":
        width = declared.shape[1]
        flat: list[float] = []
        for index, output in enumerate(outputs):
            vector = as_vector(output)
            if vector is None or len(vector) != width:
                raise ProtocolError(f"row {index}: the output is not a vector of {width}", 500)
            flat.extend(vector)
        return [Tensor(declared.name, "FP32", (len(outputs), width), flat)]
    encoded = [json.dumps(output, separators=(",", ":")).encode() for output in outputs]
    return [Tensor(declared.name, "BYTES", (len(outputs),), encoded)]


def check_outputs(spec: ModelSpec, request: InferRequest) -> None:
    """ProtocolError for an output asked for that the model does not have."""
    if request.outputs is None:
        return
    known = [t.name for t in model_outputs(spec)]
    unknown = sorted(set(request.outputs) - set(known))
    if unknown:
        names = ", ".join(known)
        raise ProtocolError(f"output {unknown[0]!r}: no such output (the model's: {names})")


def encode_response(
    model: str, version: int | None, request: InferRequest, outputs: list[Tensor]
) -> tuple[bytes, int | None]:
    """The response body, and its JSON header's length when binary tensors follow it.
    Only the outputs asked for (all when none are named; :func:`check_outputs` first)."""
    if request.outputs is not None:
        outputs = [t for t in outputs if t.name in request.outputs]
    described, binary = [], []
    for tensor in outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if request.binary(tensor.name):
            raw = to_binary(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            binary.append(raw)
        elif tensor.datatype == "BYTES":
            entry["data"] = [item.decode() for item in tensor.data]
        else:
            entry["data"] = tensor.data
        described.append(entry)
    header: dict[str, Any] = {"model_name": model, "outputs": described}
    if version is not None:
        header["model_version"] = str(version)
    if request.id is not None:
        header["id"] = request.id
    text = json.dumps(header, separators=(",", ":")).encode()
    if not binary:
        return text, None
    return b"".join([text, *binary]), len(text)


def to_binary(tensor: Tensor) -> bytes:
    if tensor.datatype == "BYTES":
        return b"".join(struct.pack("<I", len(item)) + item for item in tensor.data)
    return struct.pack(f"<{len(tensor.data)}{NUMERIC[tensor.datatype]}", *tensor.data)


# The model repository extension: the index of every model version and its state,
# and load and unload (in Ferry: taking jobs or not, and which version is active).
READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
# What load's and unload's parameters may hold, and the type each must be.
LOAD_PARAMETERS: dict[str, type] = {"version": int}
UNLOAD_PARAMETERS: dict[str, type] = {"unload_dependents": bool}
# Why a model of the repository is not served (the catalog leaves out a model with a
# problem that FERRY_MODELS does not list, and is built when the API starts).
UNSERVED = (
    "its files have a problem (ferry models check says which), or it was added after the API "
    "started"
)


def parse_index_request(body: bytes) -> bool:
    """The index request's ``ready`` (only the models ready for inference); an empty body is
    ``{}``."""
    request = _repository_request(body, {"ready"})
    ready = request.get("ready", False)
    if not isinstance(ready, bool):
        raise ProtocolError("ready must be true or false")
    return ready


def parse_load_request(body: bytes) -> int | None:
    """The version a load request activates (``parameters.version``), if it names one."""
    return load_version(_repository_parameters(body, LOAD_PARAMETERS, "load"))


def load_version(parameters: dict[str, Any]) -> int | None:
    """The version a load's checked parameters activate, if they name one."""
    version = parameters.get("version")
    if version is not None and version < 1:
        raise ProtocolError("parameters.version must be a version number (1 or more)")
    return version


def parse_unload_request(body: bytes) -> None:
    """Checks an unload request; ``unload_dependents`` is taken (Ferry's models have no
    dependents: nothing else is unloaded)."""
    _repository_parameters(body, UNLOAD_PARAMETERS, "unload")


def _repository_request(body: bytes, fields: set[str]) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("the request is not valid JSON") from None
    if not isinstance(request, dict):
        raise ProtocolError("the request must be a JSON object")
    unknown = sorted(set(request) - fields)
    if unknown:
        raise ProtocolError(
            f"{unknown[0]}: not a field of this request (it takes: {', '.join(sorted(fields))})"
        )
    return request


def _repository_parameters(body: bytes, allowed: Mapping[str, type], what: str) -> dict[str, Any]:
    parameters = _parameters(
        _repository_request(body, {"parameters"}).get("parameters"), "parameters"
    )
    return checked_repository_parameters(parameters, allowed, what)


def checked_repository_parameters(
    parameters: dict[str, Any], allowed: Mapping[str, type], what: str
) -> dict[str, Any]:
    """A load's or an unload's parameters, each one ``allowed`` and of its type."""
    for name, value in parameters.items():
        if name == "config" or name.startswith("file:"):
            raise ProtocolError(
                f"parameters.{name}: Ferry serves the models of its repository as they are; "
                "add a version folder there and load it with parameters.version"
            )
        kind = allowed.get(name)
        if kind is None:
            takes = ", ".join(allowed)
            raise ProtocolError(f"parameters.{name}: not a parameter of {what} (it takes: {takes})")
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            noun = "true or false" if kind is bool else "an integer"
            raise ProtocolError(f"parameters.{name} must be {noun}")
    return parameters


def repository_entries(
    name: str,
    versions: Sequence[int],
    active: int,
    states: Mapping[int, VersionState],
    unloaded: bool,
) -> list[dict[str, str]]:
    """The index's entries for one served model: each version, its state and why."""
    entries = []
    for version in versions:
        state, reason = _version_state(version, active, states.get(version), unloaded)
        entries.append({"name": name, "version": str(version), "state": state, "reason": reason})
    return entries


def unserved_entries(name: str, versions: Sequence[int]) -> list[dict[str, str]]:
    """The index's entries for a model of the repository that the API does not serve."""
    return [
        {"name": name, "version": str(v), "state": UNAVAILABLE, "reason": f"not served: {UNSERVED}"}
        for v in versions
    ]


def _version_state(
    version: int, active: int, reported: VersionState | None, unloaded: bool
) -> tuple[str, str]:
    if unloaded:
        return UNAVAILABLE, "unloaded: the model takes no new jobs until it is loaded"
    if version != active:
        if reported is not None and reported.state == "draining":
            return UNLOADING, f"no longer the active version ({active} is); its jobs finish"
        failed = ""
        if reported is not None and reported.state == "failed":
            failed = f"; it failed to load: {reported.reason or 'no reason given'}"
        return UNAVAILABLE, f"not the active version ({active} is){failed}"
    if reported is None:
        return UNAVAILABLE, "no live worker serves it (its jobs wait in the queue for one)"
    if reported.state == "ready":
        return READY, ""
    if reported.state == "loading":
        return LOADING, ""
    if reported.state == "draining":
        return UNLOADING, "its workers are stopping"
    return UNAVAILABLE, f"failed to load: {reported.reason or 'no reason given'}"
