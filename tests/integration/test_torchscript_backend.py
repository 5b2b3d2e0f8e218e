"""The torchscript and torch-export backends on the CPU, with small modules saved here.

Each model's outputs through the runtime are the module's own outputs, cut
per input, for batches of several sizes; the checks find files and
signatures that do not fit the model's [input].
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.base import RuntimeOptions
from backends.torchscript import BACKENDS, DECLARED_BYTES_PER_VALUE, TorchModuleRuntime
from core.config.settings import PER_MODEL
from core.models.reader import load_repository
from core.models.repository import ModelConfig

X = '[[input.tensors]]\nname = "x"\nshape = [4]\ndtype = "float32"\n'
IDS = '[[input.tensors]]\nname = "ids"\nshape = [5]\ndtype = "int64"\n'
BATCHES = (1, 3, 7)


class Dense(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Pair(torch.nn.Module):
    """Two inputs (floats and token ids), three outputs of three dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.embedding = torch.nn.Embedding(10, 3)

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.compute(x, ids)

    def compute(
        self, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        total = ids.sum(dim=1)
        return self.linear(x) + self.embedding(ids).mean(dim=1), total, total > 20


class PairDict(Pair):
    """The same, its outputs by name (TorchScript compiles no ``super()``)."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        y, total, big = self.compute(x, ids)
        return {"y": y, "total": total, "big": big}


def write_model(
    root: Path, name: str, backend: str, tensors: str, parameters: str = "", cost: int = 1
) -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "model.toml").write_text(
        f'name = "{name}"\nbackend = "{backend}"\n[input]\nkind = "tensor"\n{tensors}'
        f'[cost]\nfunction = "constant"\nvalue = {cost}\n[parameters]\n{parameters}\n'
    )
    return folder / "1"


def export(module: torch.nn.Module, example: tuple[torch.Tensor, ...], batch: Any) -> Any:
    names = ("x", "ids")[: len(example)]
    shapes = {name: {0: batch} for name in names}
    return torch.export.export(module, example, dynamic_shapes=shapes)


def examples(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 4, generator=generator)
    return x, torch.randint(0, 10, (rows, 5), generator=generator)


@pytest.fixture(scope="module")
def modules() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    dense, pair = Dense().eval(), Pair().eval()
    pair_dict = PairDict().eval()
    pair_dict.load_state_dict(pair.state_dict())
    return {"dense": dense, "pair": pair, "pair-dict": pair_dict}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, modules: dict[str, torch.nn.Module]) -> Path:
    root = tmp_path_factory.mktemp("torch") / "models"
    dense, pair, pair_dict = modules["dense"], modules["pair"], modules["pair-dict"]
    x, ids = examples(2)
    torch.jit.save(
        torch.jit.script(dense), write_model(root, "dense", "torchscript", X) / "model.pt"
    )
    torch.jit.save(
        torch.jit.script(pair), write_model(root, "pair", "torchscript", X + IDS) / "model.pt"
    )
    files = write_model(
        root, "pair-named", "torchscript", X + IDS, 'file = "pair.pt"\noutputs = ["total", "y"]'
    )
    torch.jit.save(torch.jit.script(pair_dict), files / "pair.pt")
    # The same file, by a path relative to the version's folder, with every output.
    write_model(root, "pair-all", "torchscript", X + IDS, 'file = "../../pair-named/1/pair.pt"')
    files = write_model(root, "dense-export", "torch-export", X, cost=4)
    torch.export.save(export(dense, (x,), torch.export.Dim("batch")), files / "model.pt2")
    files = write_model(
        root, "pair-export", "torch-export", X + IDS, 'outputs = ["y", "total", "big"]'
    )
    torch.export.save(export(pair, (x, ids), torch.export.Dim.DYNAMIC), files / "model.pt2")
    return root


def load_model(root: Path, name: str) -> ModelConfig:
    repository = load_repository(root, environ={}, known_settings=PER_MODEL)
    assert not repository.problems, repository.problems
    return repository[name]


def loaded(root: Path, name: str) -> TorchModuleRuntime:
    model = load_model(root, name)
    backend = BACKENDS[model.backend]
    assert backend.check(model, model.version()) == []
    runtime = backend.runtime(model, model.version(), RuntimeOptions("cpu"))
    runtime.load()
    return runtime


@pytest.fixture(scope="module")
def runtimes(models: Path) -> dict[str, TorchModuleRuntime]:
    names = ("dense", "pair", "pair-named", "pair-all", "dense-export", "pair-export")
    return {name: loaded(models, name) for name in names}


def rows(tensor: torch.Tensor) -> list[Any]:
    return [row.tolist() for row in tensor]


def assert_close(got: Any, expected: Any) -> None:
    """Equal, floats to 1e-6 (the runtime and the module may pick other kernels)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected)
        for key in expected:
            assert_close(got[key], expected[key])
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert_close(a, b)
    elif isinstance(expected, float):
        assert isinstance(got, float) and got == pytest.approx(expected, rel=1e-6, abs=1e-6)
    else:
        assert type(got) is type(expected) and got == expected


@pytest.mark.parametrize("size", BATCHES)
@pytest.mark.parametrize("name", ["dense", "dense-export"])
def test_one_tensor_in_one_out(
    name: str, size: int, runtimes: dict[str, TorchModuleRuntime], modules: Any
) -> None:
    x, _ = examples(size)
    with torch.inference_mode():
        expected = rows(modules["dense"](x))
    outputs = runtimes[name].run(x.tolist())
    assert_close(outputs, expected)


@pytest.mark.parametrize("size", BATCHES)
def test_two_tensors_in_a_tuple_out(
    size: int, runtimes: dict[str, TorchModuleRuntime], modules: Any
) -> None:
    x, ids = examples(size)
    with torch.inference_mode():
        y, total, big = modules["pair"](x, ids)
    inputs = [{"x": a, "ids": b} for a, b in zip(x.tolist(), ids.tolist(), strict=True)]
    expected = [list(row) for row in zip(rows(y), total.tolist(), big.tolist(), strict=True)]
    assert_close(runtimes["pair"].run(inputs), expected)
    # The exported one names them as parameters.outputs says.
    named = [{"y": a, "total": b, "big": c} for a, b, c in expected]
    assert_close(runtimes["pair-export"].run(inputs), named)


@pytest.mark.parametrize("size", BATCHES)
def test_a_dict_out_in_the_order_parameters_outputs_chooses(
    size: int, runtimes: dict[str, TorchModuleRuntime], modules: Any
) -> None:
    x, ids = examples(size)
    with torch.inference_mode():
        out = modules["pair-dict"](x, ids)
    inputs = [{"ids": b, "x": a} for a, b in zip(x.tolist(), ids.tolist(), strict=True)]
    expected = [
        {"total": t, "y": y} for t, y in zip(out["total"].tolist(), rows(out["y"]), strict=True)
    ]
    assert_close(runtimes["pair-named"].run(inputs), expected)
    everything = [
        {"y": y, "total": t, "big": b}
        for y, t, b in zip(rows(out["y"]), out["total"].tolist(), out["big"].tolist(), strict=True)
    ]
    assert_close(runtimes["pair-all"].run(inputs), everything)


def test_the_runtime_is_batched_and_unpadded(runtimes: dict[str, TorchModuleRuntime]) -> None:
    runtime = runtimes["pair"]
    prepared = runtime.prepare([{"x": [0.5] * 4, "ids": [1] * 5}] * 3)
    x, ids = prepared.tensors
    assert (x.shape, x.dtype, ids.shape, ids.dtype) == ((3, 4), torch.float32, (3, 5), torch.int64)
    assert not runtime.padded and not runtime.asynchronous
    inputs = [{"x": [random.random() for _ in range(4)], "ids": [i] * 5} for i in range(5)]
    assert_close(runtime.run(inputs), [runtime.run([item])[0] for item in inputs])


def test_an_input_of_the_wrong_shape_fails_its_batch(
    runtimes: dict[str, TorchModuleRuntime],
) -> None:
    with pytest.raises(ValueError, match="shape"):
        runtimes["dense"].run([[1.0, 2.0, 3.0]])


def test_declared_memory(runtimes: dict[str, TorchModuleRuntime]) -> None:
    weights = (4 * 3 + 3) * 4
    assert runtimes["dense"].declared_memory() == (weights, DECLARED_BYTES_PER_VALUE * 4)
    # Per unit of cost: an input of dense-export costs 4.
    assert runtimes["dense-export"].declared_memory() == (weights, DECLARED_BYTES_PER_VALUE)
    calibrated = runtimes["dense-export"].calibrate()
    assert calibrated is not None and calibrated[2] == 16 * 4


# check(): a model folder per case, beside the working ones.


def problems(root: Path, name: str) -> list[tuple[str, str, str]]:
    model = load_model(root, name)
    found = BACKENDS[model.backend].check(model, model.version())
    return [(p.file, p.field, p.message) for p in found]


def test_check_finds_a_missing_file(tmp_path: Path) -> None:
    write_model(tmp_path, "m", "torchscript", X)
    write_model(tmp_path, "n", "torch-export", X, 'file = "weights/net.pt2"')
    [(file, field, message)] = problems(tmp_path, "m")
    assert (file, field) == (f"{tmp_path.name}/m/1", "")
    assert message.startswith("model.pt is missing")
    [(file, field, message)] = problems(tmp_path, "n")
    assert (file, field) == (f"{tmp_path.name}/n/model.toml", "parameters.file")
    assert message.startswith("net.pt2 is missing")


@pytest.mark.parametrize(
    ("parameters", "field", "message"),
    [
        ("file = 3", "parameters.file", "must be a string"),
        ('outputs = "y"', "parameters.outputs", "must be an array of distinct output names"),
        ('outputs = ["y", "y"]', "parameters.outputs", "must be an array of distinct output names"),
        ("outputs = [1]", "parameters.outputs", "must be an array of distinct output names"),
        ("batch = 4", "parameters.batch", "is not a parameter of torchscript"),
    ],
)
def test_check_finds_bad_parameters(
    models: Path, tmp_path: Path, parameters: str, field: str, message: str
) -> None:
    files = write_model(tmp_path, "m", "torchscript", X, parameters)
    (files / "model.pt").write_bytes((models / "dense" / "1" / "model.pt").read_bytes())
    [found] = problems(tmp_path, "m")
    assert found[:2] == (f"{tmp_path.name}/m/model.toml", field)
    assert message in found[2]


def test_check_wants_tensor_inputs(models: Path, tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", "torchscript", X).parent
    (folder / "model.toml").write_text(
        'name = "m"\nbackend = "torchscript"\n[input]\nkind = "json"\n'
        '[cost]\nfunction = "constant"\n'
    )
    [found] = problems(tmp_path, "m")
    assert found == (
        f"{tmp_path.name}/m/model.toml",
        "input.kind",
        "torchscript takes tensor inputs",
    )


@pytest.mark.parametrize(
    ("backend", "source", "message"),
    [
        ("torchscript", "dense-export/1/model.pt2", "backend = 'torch-export'"),
        ("torch-export", "dense/1/model.pt", "backend = 'torchscript'"),
        ("torchscript", None, "written by torch.save"),
        ("torchscript", "dense/model.toml", "not a torch archive"),
    ],
)
def test_check_finds_a_file_of_another_format(
    models: Path, tmp_path: Path, backend: str, source: str | None, message: str
) -> None:
    files = write_model(tmp_path, "m", backend, X)
    path = files / ("model.pt" if backend == "torchscript" else "model.pt2")
    if source is None:
        torch.save(Dense().state_dict(), path)
    else:
        path.write_bytes((models / source).read_bytes())
    [(file, field, found)] = problems(tmp_path, "m")
    assert (file, field) == (f"{tmp_path.name}/m/1", "")
    assert found.startswith(f"{path.name} is not a ") and message in found


@pytest.mark.parametrize(
    ("tensors", "field", "message"),
    [
        (X + IDS, "input.tensors", "declares 2 tensors, but the exported program takes 1"),
        (
            X.replace("[4]", "[5]"),
            "input.tensors[0].shape",
            "is [5]; the exported program takes [4]",
        ),
        (
            X.replace("float32", "float16"),
            "input.tensors[0].dtype",
            "is float16; the exported program takes float32",
        ),
    ],
)
def test_check_compares_an_exported_program_with_the_inputs(
    models: Path, tmp_path: Path, tensors: str, field: str, message: str
) -> None:
    files = write_model(tmp_path, "m", "torch-export", tensors)
    (files / "model.pt2").write_bytes((models / "dense-export" / "1" / "model.pt2").read_bytes())
    [found] = problems(tmp_path, "m")
    assert found == (f"{tmp_path.name}/m/model.toml", field, message)


def test_an_exported_program_with_a_fixed_batch_is_refused(
    modules: dict[str, torch.nn.Module], tmp_path: Path
) -> None:
    files = write_model(tmp_path, "m", "torch-export", X)
    torch.export.save(
        torch.export.export(modules["dense"], (torch.zeros(3, 4),)), files / "model.pt2"
    )
    [(file, field, message)] = problems(tmp_path, "m")
    assert (file, field) == (f"{tmp_path.name}/m/model.toml", "input.tensors[0]")
    assert "batch axis for 'x' is fixed (3)" in message
    model = load_model(tmp_path, "m")
    runtime = BACKENDS["torch-export"].runtime(model, model.version(), RuntimeOptions("cpu"))
    with pytest.raises(ValueError, match=r"model.pt2: .*batch axis for 'x' is fixed \(3\)"):
        runtime.load()


def test_check_imports_no_torch(models: Path) -> None:
    """The API process checks models, and must not pay for torch."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from backends.torchscript import BACKENDS\n"
        "from core.models.reader import load_repository\n"
        "from core.config.settings import PER_MODEL\n"
        f"repository = load_repository(Path({str(models)!r}), {{}}, PER_MODEL)\n"
        "for name in repository:\n"
        "    model = repository[name]\n"
        "    assert BACKENDS[model.backend].check(model, model.version()) == [], name\n"
        "assert 'torch' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=120)
