"""The model repository: reading model.toml, versions, overrides, and every problem named."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from backends.catalog import check, model_problems
from core.config.settings import PER_MODEL
from core.models.reader import load_repository
from core.models.repository import Problem, Repository, env_name
from ferry.cli import main
from tests.models import REPOSITORY

SIM_LIKE = """
name = "{name}"
backend = "sim"
[input]
kind = "json"
[input.schema]
type = "object"
required = ["cost"]
[input.schema.properties.cost]
type = "integer"
[cost]
function = "field"
field = "cost"
max = 100
[parameters]
latency_base_ms = 5.0
crash_enabled = false
"""


def write(root: Path, name: str, toml: str, versions: tuple[str, ...] = ("1",)) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.toml").write_text(textwrap.dedent(toml).format(name=name))
    for version in versions:
        (folder / version).mkdir(exist_ok=True)
    return folder


def repo(tmp_path: Path) -> Path:
    """A repository folder named as the shipped one, so problems read models/<model>/..."""
    return tmp_path / "models"


def read(
    root: Path,
    environ: dict[str, str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Repository:
    """The repository at ``root``, reading no variable but ``environ``'s."""
    return load_repository(
        root, environ=environ or {}, known_settings=PER_MODEL, overrides=overrides
    )


def only(problems: list[Problem] | tuple[Problem, ...]) -> Problem:
    assert len(problems) == 1, problems
    return problems[0]


def test_the_shipped_repository_reads_whole() -> None:
    repository = read(REPOSITORY)
    assert not repository.problems
    assert set(repository.models) == {"minilm", "resnet50", "sim", "tiny-gpt2", "tiny-llama"}
    minilm = repository["minilm"]
    assert (minilm.backend, minilm.input.kind, minilm.cost.function) == (
        "sentence-transformers", "text", "tokens",
    )  # fmt: skip
    # version.toml names a package: its files are the weights it installed.
    assert (minilm.version().files / "modules.json").is_file()
    assert minilm.tokenizer_path() == minilm.version().files / "tokenizer.json"
    assert repository["sim"].device == "none"
    # Only resnet50's weights are missing, and only as a warning while it is not served;
    # so are the tiny models' files until their first start builds them (ferry.built_models).
    problems = check(repository, served=["minilm", "sim"])
    tiny = [p for p in problems if p.file.startswith("models/tiny-")]
    assert all(p.warning for p in tiny)
    assert [(p.file, p.warning) for p in problems if p not in tiny] == [("models/resnet50/1", True)]
    assert not check(repository, served=["minilm", "sim", "resnet50"])[0].warning


def test_versions_and_the_active_one(tmp_path: Path) -> None:
    write(repo(tmp_path), "m", SIM_LIKE, versions=("1", "2", "10"))
    assert read(repo(tmp_path))["m"].active_version == 10  # the highest by default
    (repo(tmp_path) / "m" / "model.toml").write_text(
        SIM_LIKE.format(name="m").replace('backend = "sim"', 'backend = "sim"\nactive_version = 2')
    )
    model = read(repo(tmp_path))["m"]
    assert (model.active_version, sorted(model.versions)) == (2, [1, 2, 10])
    assert model.version().folder == repo(tmp_path) / "m" / "2"


def test_a_version_toml_points_at_files_elsewhere(tmp_path: Path) -> None:
    elsewhere = tmp_path / "weights"
    elsewhere.mkdir()
    write(tmp_path / "repo", "m", SIM_LIKE)
    (tmp_path / "repo" / "m" / "1" / "version.toml").write_text(f'files = "{elsewhere}"\n')
    assert read(tmp_path / "repo")["m"].version().files == elsewhere.resolve()
    (tmp_path / "repo" / "m" / "1" / "version.toml").write_text('files = "../nowhere"\n')
    problem = only(read(tmp_path / "repo").problems)
    assert (problem.file, problem.field) == ("repo/m/1/version.toml", "files")
    assert "is not a folder" in problem.message


def test_environment_and_explicit_overrides_take_the_files_types(tmp_path: Path) -> None:
    write(repo(tmp_path), "my-model", SIM_LIKE)
    assert env_name("my-model", "latency_base_ms") == "FERRY_MY_MODEL_LATENCY_BASE_MS"
    environ = {"FERRY_MY_MODEL_LATENCY_BASE_MS": "7", "FERRY_MY_MODEL_CRASH_ENABLED": "true"}
    model = read(repo(tmp_path), environ=environ)["my-model"]
    assert model.parameters["latency_base_ms"] == 7.0
    assert model.parameters["crash_enabled"] is True
    explicit = read(
        repo(tmp_path), environ=environ, overrides={"my-model": {"latency_base_ms": 9.0}}
    )
    assert explicit["my-model"].parameters["latency_base_ms"] == 9.0  # wins over the env
    bad = read(repo(tmp_path), environ={"FERRY_MY_MODEL_CRASH_ENABLED": "maybe"})
    problem = only(bad.problems)
    assert (problem.field, problem.file) == (
        "parameters.crash_enabled",
        "models/my-model/model.toml",
    )
    assert "FERRY_MY_MODEL_CRASH_ENABLED='maybe': must be true or false" in problem.message
    typo = only(read(repo(tmp_path), overrides={"my-model": {"latency_bse_ms": 1}}).problems)
    assert typo.field == "parameters.latency_bse_ms" and "declares no such key" in typo.message


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        (lambda t: "colour = 1\n" + t, "colour", "is not a field of model.toml"),
        (lambda t: t.replace('name = "m"', 'name = "other"'), "name", "the folder is 'm'"),
        (lambda t: t.replace('backend = "sim"\n', ""), "backend", "is missing"),
        (lambda t: t.replace('kind = "json"', 'kind = "audio"'), "input.kind", "'audio'"),
        (
            lambda t: t.replace('kind = "json"', 'kind = "json"\nmax_tokens = 3'),
            "input.max_tokens",
            "is not a field of json inputs",
        ),
        (
            lambda t: t.replace('type = "object"', 'type = "thing"'),
            "input.schema",
            "is not a valid JSON Schema",
        ),
        (
            lambda t: t.replace('function = "field"', 'function = "tokens"'),
            "cost.function",
            "'tokens' prices text inputs; this model takes json",
        ),
        (lambda t: t.replace('field = "cost"\n', ""), "cost.field", "must name the input's member"),
        (lambda t: t.replace("max = 100", "max = 0"), "cost.max", "must be at least 1"),
        (
            lambda t: t + "\n[batching]\nbatch_max_sise = 3\n",
            "batching.batch_max_sise",
            "is not a setting of [batching]",
        ),
        (
            lambda t: t + "\n[memory]\nbatch_max_size = 3\n",
            "memory.batch_max_size",
            "is not a setting of [memory]",
        ),
        (lambda t: t + "\n[instances]\ndevice = 'tpu'\n", "instances.device", "'tpu'"),
        (
            lambda t: t.replace('backend = "sim"', 'backend = "sim"\nactive_version = 3'),
            "active_version",
            "there is no folder m/3",
        ),
        (
            lambda t: t.replace('backend = "sim"', 'backend = "sim"\nprecision = "fp8"'),
            "precision",
            "one of fp32, fp16, bf16",
        ),
        (lambda t: t + "\n[cost]\n", "", "is not valid TOML"),
        (
            lambda t: t + "\n[embeddings]\ndimensions = 8\n",
            "embeddings",
            "needs a text [input]; this model's is json",
        ),
        (lambda t: t + "\n[embeddings]\n", "embeddings.dimensions", "is required"),
        (
            lambda t: t + "\n[embeddings]\ndimensions = 0\n",
            "embeddings.dimensions",
            "must be at least 1",
        ),
        (
            lambda t: t + "\n[embeddings]\ndimensions = 8\nsize = 3\n",
            "embeddings.size",
            "is not a field of [embeddings]",
        ),
    ],
)
def test_each_problem_names_the_file_and_field(
    tmp_path: Path, edit: object, field: str, message: str
) -> None:
    write(repo(tmp_path), "m", edit(SIM_LIKE.format(name="m")))  # type: ignore[operator]
    repository = read(repo(tmp_path))
    assert "m" not in repository.models
    problem = next(p for p in repository.problems if p.field == field)
    assert problem.file == "models/m/model.toml"
    assert message in problem.message, problem
    assert str(problem).startswith(
        f"models/m/model.toml: {field}: " if field else "models/m/model.toml: "
    )


def test_a_folder_without_model_toml_or_versions(tmp_path: Path) -> None:
    repo(tmp_path).joinpath("stray").mkdir(parents=True)
    write(repo(tmp_path), "m", SIM_LIKE, versions=("01",))
    write(repo(tmp_path), "n", SIM_LIKE, versions=())
    messages = {str(p) for p in read(repo(tmp_path)).problems}
    assert "models/stray: has no model.toml (every model folder needs one)" in messages
    assert "models/m/01: is not a version's name (versions are named 1, 2, 3 ...)" in messages
    assert (
        "models/n/model.toml: has no version folder (a folder named 1, 2, ... beside it "
        "holds the files)" in messages
    )


def test_tensor_inputs_declare_shapes_and_dtypes(tmp_path: Path) -> None:
    toml = """
    name = "{name}"
    backend = "python"
    [input]
    kind = "tensor"
    [[input.tensors]]
    name = "x"
    shape = [2, 3]
    dtype = "float32"
    [[input.tensors]]
    name = "ids"
    shape = [0]
    dtype = "int64"
    [cost]
    function = "constant"
    [parameters]
    class = "m:M"
    """
    write(repo(tmp_path), "t", toml)
    problem = only(read(repo(tmp_path)).problems)
    assert (problem.field, problem.file) == ("input.tensors[1].shape", "models/t/model.toml")
    write(repo(tmp_path), "t", toml.replace("[0]", "[4]").replace('"int64"', '"complex"'))
    assert only(read(repo(tmp_path)).problems).field == "input.tensors[1].dtype"
    write(repo(tmp_path), "t", toml.replace("[0]", "[4]"))
    tensors = read(repo(tmp_path))["t"].input.tensors
    assert [(t.name, t.shape, t.dtype) for t in tensors] == [
        ("x", (2, 3), "float32"), ("ids", (4,), "int64"),
    ]  # fmt: skip


def test_backend_problems_name_the_file_and_field(tmp_path: Path) -> None:
    write(repo(tmp_path), "m", SIM_LIKE.replace('backend = "sim"', 'backend = "tensorrt"'))
    problem = only(model_problems(read(repo(tmp_path))["m"]))
    assert (problem.file, problem.field) == ("models/m/model.toml", "backend")
    assert "unknown backend 'tensorrt'" in problem.message and "onnx" in problem.message

    write(repo(tmp_path), "m", SIM_LIKE.replace("crash_enabled = false", "crash_enabled = 1"))
    problem = only(model_problems(read(repo(tmp_path))["m"]))
    assert (problem.field, problem.message) == ("parameters.crash_enabled", "must be true or false")

    write(repo(tmp_path), "m", SIM_LIKE + "\nlatency_bogus = 1\n")
    assert only(model_problems(read(repo(tmp_path))["m"])).field == "parameters.latency_bogus"

    write(repo(tmp_path), "m", SIM_LIKE + "\n[batching]\nbatch_max_size = 0\n")
    problem = only(model_problems(read(repo(tmp_path))["m"]))
    assert problem.field == "batching.batch_max_size" and "greater than or equal to 1" in str(
        problem
    )

    text = SIM_LIKE.replace('kind = "json"', 'kind = "text"').split("[input.schema]")[0]
    write(repo(tmp_path), "m", text + '\n[cost]\nfunction = "constant"\n')
    problem = only(model_problems(read(repo(tmp_path))["m"]))
    assert (problem.field, problem.message) == ("input.kind", "sim takes json inputs, not text")


def test_python_models_name_a_class_that_exists(tmp_path: Path) -> None:
    toml = """
    name = "{name}"
    backend = "python"
    [input]
    kind = "json"
    [cost]
    function = "constant"
    [parameters]
    class = "{target}"
    """
    for target, message in [
        ("model", "is not 'module:Class'"),
        ("missing_module_xyz:Model", "missing_module_xyz.py is missing"),
    ]:
        write(repo(tmp_path), "p", toml.replace("{target}", target))
        problem = only(model_problems(read(repo(tmp_path))["p"]))
        assert message in problem.message, problem
    write(repo(tmp_path), "p", toml.replace("{target}", "model:Model"))
    (repo(tmp_path) / "p" / "1" / "model.py").write_text("class Modle: ...\n")
    problem = only(model_problems(read(repo(tmp_path))["p"]))
    assert (problem.file, problem.message) == (
        "models/p/1/model.py", "defines no class 'Model' (parameters.class names it)",
    )  # fmt: skip
    (repo(tmp_path) / "p" / "1" / "model.py").write_text("class Model: ...\n")
    assert model_problems(read(repo(tmp_path))["p"]) == []
    # The file is read, never run: code at its top level does not run in the API.
    (repo(tmp_path) / "p" / "1" / "model.py").write_text("raise SystemExit(9)\nclass Model: ...\n")
    assert model_problems(read(repo(tmp_path))["p"]) == []


def test_ferry_models_check_exits_non_zero_and_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FERRY_MODELS", raising=False)
    from core.config.settings import get_settings

    get_settings.cache_clear()
    write(repo(tmp_path), "good", SIM_LIKE)
    assert main(["models", "check", str(repo(tmp_path))]) == 0
    assert "ready to serve" in capsys.readouterr().out
    write(repo(tmp_path), "bad", SIM_LIKE.replace('function = "field"', 'function = "pixels"'))
    assert main(["models", "check", str(repo(tmp_path))]) == 1
    out = capsys.readouterr().out
    assert "error: " in out and "models/bad/model.toml: cost.function: 'pixels' prices image" in out
    get_settings.cache_clear()


@pytest.mark.parametrize(
    ("version_toml", "message"),
    [
        ('package = ""', "must be a module name, got ''"),
        ('package = ".x"', "must be a module name, got '.x'"),
        ("package = 3", "must be a module name, got 3"),
        ('package = "no_such_package_xyz"', "cannot be imported"),
        ('package = "json"', None),  # a plain package: its own folder
    ],
)
def test_a_version_toml_package_is_checked_not_trusted(
    tmp_path: Path, version_toml: str, message: str | None
) -> None:
    write(repo(tmp_path), "m", SIM_LIKE)
    (repo(tmp_path) / "m" / "1" / "version.toml").write_text(version_toml + "\n")
    repository = read(repo(tmp_path))
    if message is None:
        assert not repository.problems
        assert (repository["m"].version().files / "decoder.py").is_file()
        return
    problem = only(repository.problems)
    assert (problem.file, problem.field) == ("models/m/1/version.toml", "package")
    assert message in problem.message


def test_odd_folders_and_overrides_are_problems_not_crashes(tmp_path: Path) -> None:
    write(repo(tmp_path), "m", SIM_LIKE, versions=("1", "²"))
    repository = read(repo(tmp_path), overrides={"nosuch": {"x": 1}})
    assert sorted(repository["m"].versions) == [1]  # '²' is no version number
    problem = only(repository.problems)
    assert problem.file == "models/nosuch" and "FERRY_MODEL_PARAMETERS" in problem.message


def test_a_tokens_cost_needs_the_tokenizer_file_in_every_version(tmp_path: Path) -> None:
    toml = """
    name = "{name}"
    backend = "python"
    [input]
    kind = "text"
    tokenizer = "tokenizer.json"
    [cost]
    function = "tokens"
    [parameters]
    class = "model:M"
    """
    write(repo(tmp_path), "t", toml)
    (repo(tmp_path) / "t" / "1" / "model.py").write_text("class M: ...\n")
    problem = only(model_problems(read(repo(tmp_path))["t"]))
    assert problem.file == "models/t/1" and "tokenizer.json is missing" in problem.message


def test_a_broken_sentence_transformers_folder_is_a_problem(tmp_path: Path) -> None:
    toml = """
    name = "{name}"
    backend = "sentence-transformers"
    [input]
    kind = "text"
    [cost]
    function = "constant"
    """
    write(repo(tmp_path), "st", toml)
    files = repo(tmp_path) / "st" / "1"
    (files / "modules.json").write_text(
        '[{"type": "sentence_transformers.models.Transformer", "path": ""},'
        ' {"type": "sentence_transformers.models.Pooling", "path": "p"}]'
    )
    (files / "p").mkdir()
    (files / "p" / "config.json").write_text("[1, 2]")
    problem = only(model_problems(read(repo(tmp_path))["st"]))
    assert "config.json must be a JSON object" in problem.message
