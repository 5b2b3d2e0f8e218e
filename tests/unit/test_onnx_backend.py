"""The onnx backend on small graphs built here: batches of any size, text and tensors, check()."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends import get_backend
from backends.base import RuntimeOptions
from backends.onnx import BACKENDS, OnnxRuntime, session_providers
from core.config.settings import PER_MODEL
from core.models.reader import load_repository
from core.models.repository import ModelConfig, Problem

TENSOR_TOML = """\
name = "{name}"
backend = "onnx"
[input]
kind = "tensor"
[[input.tensors]]
name = "x"
shape = [4]
dtype = "float32"
[cost]
function = "constant"
"""
WEIGHTS = np.arange(8, dtype=np.float32).reshape(4, 2) / 10
BIAS = np.array([0.5, -1.0], dtype=np.float32)
VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "b", "c", "d"]


def save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every onnxruntime of the last years reads
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def affine_graph(batch: str | int = "batch", input_name: str = "x") -> onnx.GraphProto:
    """``y = x @ W + b`` (4 -> 2) and ``doubled = 2x``."""
    return helper.make_graph(
        [
            helper.make_node("MatMul", [input_name, "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
            helper.make_node("Add", [input_name, input_name], ["doubled"]),
        ],
        "affine",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [batch, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2]),
            helper.make_tensor_value_info("doubled", TensorProto.FLOAT, [batch, 4]),
        ],
        [numpy_helper.from_array(WEIGHTS, "W"), numpy_helper.from_array(BIAS, "b")],
    )


def two_input_graph() -> onnx.GraphProto:
    """``total = a + float(b)`` and ``count = sum(b)`` per row, an int64."""
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    return helper.make_graph(
        [
            helper.make_node("Cast", ["b"], ["b_float"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["a", "b_float"], ["total"]),
            helper.make_node("ReduceSum", ["b", "axes"], ["count"], keepdims=0),
        ],
        "two",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("b", TensorProto.INT64, ["n", 3]),
        ],
        [
            helper.make_tensor_value_info("total", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("count", TensorProto.INT64, ["n"]),
        ],
        [axes],
    )


def text_graph() -> onnx.GraphProto:
    """``tokens``: each text's token count from the mask; ``ids``: the ids, token by token."""
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    return helper.make_graph(
        [
            helper.make_node("ReduceSum", ["attention_mask", "axes"], ["tokens"], keepdims=0),
            helper.make_node("Identity", ["input_ids"], ["ids"]),
        ],
        "text",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch", "sequence"]
            ),
        ],
        [
            helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [axes],
    )


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(
        models.WordLevel({word: i for i, word in enumerate(VOCABULARY)}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


def repository(root: Path, name: str, toml: str) -> ModelConfig:
    """A repository under ``root`` holding one model; its folder 1/ is made, empty."""
    folder = root / "models" / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "model.toml").write_text(toml)
    repo = load_repository(root / "models", environ={}, known_settings=PER_MODEL)
    assert not repo.problems, repo.problems
    return repo[name]


def tensor_model(tmp_path: Path, extra: str = "", graph: onnx.GraphProto | None = None) -> Any:
    model = repository(tmp_path, "affine", TENSOR_TOML.format(name="affine") + extra)
    save(graph or affine_graph(), model.version().files / "model.onnx")
    return model


def loaded(model: ModelConfig, **options: Any) -> OnnxRuntime:
    runtime = BACKENDS["onnx"].runtime(model, model.version(), RuntimeOptions("cpu", **options))
    runtime.load()
    return runtime


def check(model: ModelConfig) -> list[Problem]:
    return BACKENDS["onnx"].check(model, model.version())


def test_the_registry_finds_it() -> None:
    backend = get_backend("onnx")
    assert backend is BACKENDS["onnx"]
    assert backend.input_kinds == {"text", "tensor"} and backend.uses_device


@pytest.mark.parametrize("size", [1, 3, 8])
def test_a_tensor_model_runs_batches_of_any_size(tmp_path: Path, size: int) -> None:
    model = tensor_model(tmp_path)
    assert check(model) == []
    runtime = loaded(model)
    assert not runtime.padded and not runtime.asynchronous and runtime.device == "cpu"
    inputs = np.random.default_rng(size).normal(size=(size, 4)).astype(np.float32)
    outputs = runtime.run(inputs.tolist())
    assert len(outputs) == size
    expected = inputs @ WEIGHTS + BIAS  # the first output unless told otherwise
    for row, want in zip(outputs, expected, strict=True):
        assert isinstance(row, list) and all(isinstance(v, float) for v in row)
        assert row == pytest.approx(want.tolist(), rel=1e-5, abs=1e-6)


def test_the_output_parameter_chooses_the_output(tmp_path: Path) -> None:
    model = tensor_model(tmp_path, '[parameters]\noutput = "doubled"\nintra_op_threads = 1\n')
    assert check(model) == []
    outputs = loaded(model).run([[1.0, 2.0, 3.0, 4.5]])
    assert outputs == [[2.0, 4.0, 6.0, 9.0]]


def test_named_tensors_are_stacked_and_fed_by_name(tmp_path: Path) -> None:
    toml = textwrap.dedent("""\
        name = "two"
        backend = "onnx"
        [input]
        kind = "tensor"
        [[input.tensors]]
        name = "a"
        shape = [3]
        dtype = "float32"
        [[input.tensors]]
        name = "b"
        shape = [3]
        dtype = "int64"
        [cost]
        function = "constant"
        value = 2
        [parameters]
        output = "count"
        """)
    model = repository(tmp_path, "two", toml)
    save(two_input_graph(), model.version().files / "model.onnx")
    assert check(model) == []
    runtime = loaded(model)
    inputs = [{"a": [0.5, 1.0, 1.5], "b": [1, 2, 3]}, {"b": [0, 0, 7], "a": [0.0, 0.0, 0.0]}]
    assert runtime.run(inputs) == [6, 7]  # integers stay integers
    runtime.output = "total"
    assert runtime.run(inputs) == [[1.5, 3.0, 4.5], [0.0, 0.0, 7.0]]
    weights, per_cost = runtime.declared_memory()
    assert weights == (model.version().files / "model.onnx").stat().st_size
    assert per_cost == 1024 * (3 + 3) / 2  # both tensors' values, per unit of cost


def text_model(tmp_path: Path, parameters: str = "") -> ModelConfig:
    toml = textwrap.dedent("""\
        name = "words"
        backend = "onnx"
        [input]
        kind = "text"
        max_tokens = 6
        tokenizer = "tokenizer.json"
        [cost]
        function = "tokens"
        """)
    model = repository(tmp_path, "words", toml + parameters)
    save(text_graph(), model.version().files / "model.onnx")
    save_tokenizer(model.version().files / "tokenizer.json")
    return model


def test_a_text_model_is_tokenised_truncated_and_padded(tmp_path: Path) -> None:
    model = text_model(tmp_path)
    assert check(model) == []
    runtime = loaded(model)
    assert runtime.padded
    texts = ["a b c", "d", "a b c d a b c d", "zzz"]
    # [CLS] and [SEP] around each text's words, cut at max_tokens (6).
    assert runtime.run(texts) == [5, 3, 6, 3]
    runtime.output = "ids"
    runtime._bind(runtime._session)
    # A token-level output is cut back to each text's own tokens: no padding.
    assert runtime.run(texts) == [[2, 4, 5, 6, 3], [2, 7, 3], [2, 4, 5, 6, 7, 3], [2, 1, 3]]
    prepared = runtime.prepare(texts)
    assert set(prepared.feed) == {"input_ids", "attention_mask"}  # the graph takes no types
    assert (
        prepared.feed["input_ids"].shape == (4, 6) and prepared.feed["input_ids"].dtype == "int64"
    )
    launched = runtime.launch(prepared)
    assert launched.device_s > 0 and launched.peak_memory_bytes is None
    assert runtime.collect(launched) == runtime.run(texts)
    weights, per_token = runtime.declared_memory()
    assert weights > 0 and per_token == 64 * 1024
    a, b, span = runtime.calibrate() or (-1.0, -1.0, -1.0)
    assert a >= 0 and b >= 0 and span == 16 * 6


def test_check_names_a_missing_graph(tmp_path: Path) -> None:
    model = repository(tmp_path, "affine", TENSOR_TOML.format(name="affine"))
    assert check(model) == [
        Problem(
            "models/affine/1",
            "",
            f"model.onnx is missing (onnx needs it; looked in {model.version().files})",
        )
    ]


def test_check_names_a_missing_file_parameter(tmp_path: Path) -> None:
    model = tensor_model(tmp_path, '[parameters]\nfile = "other.onnx"\n')
    [problem] = check(model)
    assert (problem.file, problem.field) == ("models/affine/1", "parameters.file")
    assert problem.message.startswith("other.onnx is missing")


def test_check_names_parameters_of_the_wrong_type(tmp_path: Path) -> None:
    toml = '[parameters]\nintra_op_threads = "4"\nproviders = [1]\nthreads = 2\noutput = 3\n'
    model = tensor_model(tmp_path, toml)
    problems = {(p.file, p.field): p.message for p in check(model)}
    assert problems == {
        ("models/affine/model.toml", "parameters.intra_op_threads"): "must be an integer",
        ("models/affine/model.toml", "parameters.output"): "must be a string",
        ("models/affine/model.toml", "parameters.threads"): (
            "is not a parameter of onnx (file, intra_op_threads, output, providers)"
        ),
        ("models/affine/model.toml", "parameters.providers"): (
            "must be an execution provider's name or a list of them "
            '(["CUDAExecutionProvider", "CPUExecutionProvider"])'
        ),
    }


def test_check_refuses_an_input_kind_it_cannot_take(tmp_path: Path) -> None:
    toml = 'name = "j"\nbackend = "onnx"\n[input]\nkind = "json"\n[cost]\nfunction = "constant"\n'
    model = repository(tmp_path, "j", toml)
    assert check(model) == [
        Problem(
            "models/j/model.toml",
            "input.kind",
            "is 'json'; the onnx backend takes text or tensor inputs",
        )
    ]


def test_check_wants_a_tokenizer_for_text(tmp_path: Path) -> None:
    toml = 'name = "t"\nbackend = "onnx"\n[input]\nkind = "text"\n[cost]\nfunction = "constant"\n'
    model = repository(tmp_path, "t", toml)
    save(text_graph(), model.version().files / "model.onnx")
    [problem] = check(model)
    assert (problem.file, problem.field) == ("models/t/model.toml", "input.tokenizer")
    model = text_model(tmp_path / "other")
    (model.version().files / "tokenizer.json").unlink()
    [problem] = check(model)
    assert problem.file == "models/words/1"
    assert problem.message.startswith("tokenizer.json is missing")


def test_check_compares_the_graph_with_the_declared_tensors(tmp_path: Path) -> None:
    toml = TENSOR_TOML.replace('shape = [4]\ndtype = "float32"', 'shape = [5]\ndtype = "int64"')
    model = repository(tmp_path, "affine", toml.format(name="affine"))
    save(affine_graph(), model.version().files / "model.onnx")
    problems = {(p.field, p.message) for p in check(model)}
    assert problems == {
        ("input.tensors[0].dtype", "is 'int64', but model.onnx takes float32 for 'x'"),
        ("input.tensors[0].shape", "axis 0 is 5; model.onnx takes 4 for 'x'"),
    }
    save(affine_graph(input_name="pixels"), model.version().files / "model.onnx")
    problems = {(p.field, p.message) for p in check(model)}
    assert problems == {
        ("input.tensors[0].name", "'x' is not an input of model.onnx (pixels)"),
        ("input.tensors", "does not declare 'pixels', an input model.onnx needs"),
    }
    with pytest.raises(RuntimeError, match=r"takes pixels; \[input.tensors\] declares x"):
        loaded(model)


def test_check_wants_a_dynamic_batch_axis_and_a_known_output(tmp_path: Path) -> None:
    model = tensor_model(tmp_path, '[parameters]\noutput = "logits"\n', affine_graph(batch=1))
    problems = {(p.file, p.field, p.message) for p in check(model)}
    assert problems == {
        (
            "models/affine/1",
            "",
            "model.onnx: input 'x' has a fixed batch axis of 1 "
            "(export it with a dynamic first axis)",
        ),
        (
            "models/affine/model.toml",
            "parameters.output",
            "'logits' is not an output of model.onnx (y, doubled)",
        ),
    }


def test_check_refuses_bfloat16_tensors(tmp_path: Path) -> None:
    toml = TENSOR_TOML.replace('dtype = "float32"', 'dtype = "bfloat16"')
    model = repository(tmp_path, "affine", toml.format(name="affine"))
    save(affine_graph(), model.version().files / "model.onnx")
    fields = [p.field for p in check(model)]
    assert fields[0] == "input.tensors[0].dtype"


def test_check_reads_an_unreadable_graph_as_a_problem(tmp_path: Path) -> None:
    model = repository(tmp_path, "affine", TENSOR_TOML.format(name="affine"))
    (model.version().files / "model.onnx").write_bytes(b"not a protobuf at all")
    [problem] = check(model)
    assert problem.message.startswith("model.onnx cannot be read as an ONNX model")


def test_check_imports_neither_onnxruntime_nor_torch(tmp_path: Path) -> None:
    tensor_model(tmp_path)
    script = textwrap.dedent(f"""\
        import sys
        from core.models.reader import load_repository
        from backends.onnx import BACKENDS
        model = load_repository({str(tmp_path / "models")!r}, environ={{}})["affine"]
        assert BACKENDS["onnx"].check(model, model.version()) == []
        loaded = sorted(m for m in ("onnxruntime", "torch") if m in sys.modules)
        assert not loaded, loaded
        """)
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=120)


def test_providers_follow_the_device() -> None:
    available = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert session_providers("cpu", None, available) == [("CPUExecutionProvider", {})]
    # A CPU worker never touches the GPU, even when [parameters] lists it.
    assert session_providers("cpu", available, available) == [("CPUExecutionProvider", {})]
    assert session_providers("cuda:1", None, available, budget_bytes=2**30) == [
        (
            "CUDAExecutionProvider",
            {"device_id": 1, "arena_extend_strategy": "kSameAsRequested", "gpu_mem_limit": 2**30},
        ),
        ("CPUExecutionProvider", {}),
    ]
    # The CPU-only onnxruntime: the model still runs, on the CPU.
    assert session_providers("cuda:0", None, ["CPUExecutionProvider"]) == [
        ("CPUExecutionProvider", {})
    ]
    with pytest.raises(RuntimeError, match="TensorrtExecutionProvider is not in this onnxruntime"):
        session_providers("cuda:0", ["TensorrtExecutionProvider"], available)


def test_a_runtime_on_the_cpu_runs_on_the_cpu_provider(tmp_path: Path) -> None:
    model = tensor_model(tmp_path, '[parameters]\nproviders = "CPUExecutionProvider"\n')
    runtime = loaded(model)
    assert runtime._session.get_providers() == ["CPUExecutionProvider"]
    assert runtime.memory_budget_bytes() == 4 * 2**30
    assert loaded(model, budget_bytes=2**28).memory_budget_bytes() == 2**28


def test_without_a_cuda_provider_a_cuda_worker_computes_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime

    # The CPU build, whichever build is installed (onnxruntime-gpu lists CUDA too).
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    # A model meant for cuda:0 still runs on the CPU build, and says where.
    model = tensor_model(tmp_path)
    runtime = BACKENDS["onnx"].runtime(model, model.version(), RuntimeOptions("cuda:0"))
    runtime.load()
    assert runtime.device == "cpu"
    assert runtime._session.get_providers() == ["CPUExecutionProvider"]
    assert runtime.run([[0.0, 0.0, 0.0, 0.0]]) == [pytest.approx(BIAS.tolist())]
