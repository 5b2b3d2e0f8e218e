"""The shipped generation models (tiny-llama, tiny-gpt2): read before their files exist,
built from their lm-build.toml on first start, the same bytes for the same recipe."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from backends.catalog import check
from core.config.settings import PER_MODEL, Settings
from core.models.generation import generation_spec
from core.models.inputs import InputError
from core.models.reader import load_repository
from core.models.repository import Repository
from ferry.built_models import (
    FILES,
    RECIPE,
    STAMP,
    BuiltVersion,
    RecipeError,
    build,
    build_missing,
    built_versions,
    read_recipe,
)
from ferry.cli import main
from ferry.lm_build import readme
from ferry.up import up

SHIPPED = Path(__file__).resolve().parents[2] / "models"
TINY = ("tiny-gpt2", "tiny-llama")


def shipped_copy(root: Path, models: tuple[str, ...] = TINY) -> Path:
    """The committed files of the tiny models (model.toml, the recipe), nothing built."""
    for name in models:
        (root / name / "1").mkdir(parents=True)
        shutil.copy(SHIPPED / name / "model.toml", root / name / "model.toml")
        shutil.copy(SHIPPED / name / "1" / RECIPE, root / name / "1" / RECIPE)
    return root


def read(root: Path) -> Repository:
    return load_repository(root, environ={}, known_settings=PER_MODEL)


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = shipped_copy(tmp_path_factory.mktemp("shipped") / "models")
    for version in built_versions(root):
        assert build(version)
    return root


def test_unbuilt_they_read_whole_and_only_their_files_are_missing(tmp_path: Path) -> None:
    root = shipped_copy(tmp_path / "models")
    repository = read(root)
    # No problem of the repository itself: another model is served without building these.
    assert not repository.problems
    assert set(repository.models) == set(TINY)
    for name in TINY:
        model = repository[name]
        assert (model.backend, model.input.kind, model.cost.function) == (
            "causal-lm", "generation", "tokens",
        )  # fmt: skip
        assert "noise" in model.description
    problems = check(repository, served=[])
    assert problems and all(p.warning for p in problems)
    assert {p.file for p in problems} == {f"models/{name}/1" for name in TINY}
    served = check(repository, served=["tiny-llama"])
    assert {p.file for p in served if not p.warning} == {"models/tiny-llama/1"}
    for version in built_versions(root):
        assert version.missing() == list(FILES)
        assert version.unbuilt() == "its files are not built yet"


@pytest.mark.parametrize("name", TINY)
def test_the_recipe_agrees_with_model_toml(name: str) -> None:
    version = read_recipe(name, SHIPPED / name / "1")
    config = load_repository(SHIPPED, environ={}, known_settings=PER_MODEL, only=name)[name]
    assert (version.model, version.number) == (name, 1)
    assert version.shape.arch == name.removeprefix("tiny-")
    # model.toml gives the context itself so the repository reads before the build.
    assert config.input.context_tokens == version.shape.context_tokens


def test_built_they_pass_the_check_and_take_prompts_and_chat(built: Path) -> None:
    repository = read(built)
    assert check(repository, served=list(TINY)) == []
    llama = generation_spec(repository["tiny-llama"])
    chat = llama.validate({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    assert chat.input["prompt"].startswith("<|im_start|>user\nHello<|im_end|>")
    gpt2 = generation_spec(repository["tiny-gpt2"])
    assert gpt2.validate({"prompt": "A ferry", "max_tokens": 8}).cost > 8
    with pytest.raises(InputError, match="has no chat template"):
        gpt2.validate({"messages": [{"role": "user", "content": "Hello"}]})
    for version in built_versions(built):
        assert version.unbuilt() is None
        # build_lm writes exactly FILES: a new file would be left out of the move.
        assert {p.name for p in version.folder.iterdir() if not p.name.startswith(".")} == {
            *FILES,
            RECIPE,
        }
        assert all((version.folder / n).stat().st_mode & 0o044 == 0o044 for n in FILES)


def test_the_same_recipe_gives_the_same_bytes(built: Path, tmp_path: Path) -> None:
    version = read_recipe("tiny-llama", built / "tiny-llama" / "1")
    again = version.build_files(tmp_path / "again")
    assert digests(again) == digests(version.folder)


def test_a_built_folder_is_kept_and_a_damaged_or_stale_one_is_built_again(
    built: Path,
) -> None:
    version = read_recipe("tiny-gpt2", built / "tiny-gpt2" / "1")
    before = digests(version.folder)
    assert version.stamp() == version.signature
    assert not build(version)  # built already
    (version.folder / "tokenizer.json").unlink()
    assert version.unbuilt() == "tokenizer.json is missing"
    assert build(version)
    assert digests(version.folder) == before

    other = BuiltVersion(version.model, 1, version.folder, version.shape, seed=7)
    assert other.unbuilt() == f"its files were built from other values than {RECIPE}'s"
    assert build(other)
    assert (version.folder / "README.md").read_text() == readme(version.shape, 7)
    assert digests(version.folder)["model.safetensors"] != before["model.safetensors"]
    assert version.unbuilt() is not None  # the recipe's seed is 0: stale now
    assert build(version)
    assert digests(version.folder) == before
    assert not [p for p in version.folder.iterdir() if p.name.startswith(".lm-build-")]

    # A build killed while it moved the files in.
    (version.folder / STAMP).write_text("building\n")
    assert version.unbuilt() == "its last build did not finish"
    assert build(version)
    assert version.unbuilt() is None


def test_a_real_models_files_in_its_place_are_never_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = shipped_copy(tmp_path / "models")
    folder = root / "tiny-llama" / "1"
    # Someone's own model, put where the recipe would build (a README of its own, no stamp).
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        (folder / name).write_text(f"their {name}")
    version = read_recipe("tiny-llama", folder)
    assert version.foreign()
    assert version.unbuilt() is None
    said: list[str] = []
    assert build_missing(root, ["tiny-llama"], said.append)
    assert said == []
    assert not build(version)
    assert main(["models", "build", "tiny-llama", "--repository", str(root)]) == 0
    assert "holds model files no recipe built; they are left as they are" in (
        capsys.readouterr().out
    )
    assert (folder / "README.md").read_text() == "their README.md"
    assert build(version, force=True)  # asked for by name: `ferry models build --force`
    assert not version.foreign() and version.unbuilt() is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('arch = "llama"', "seed: is required"),
        ("seed = 0", "arch: is required"),
        ('arch = "llama"\nseed = 0\nwidth = 3', "width: is not a field"),
        ('arch = "llama"\nseed = 0\nlayers = "4"', "layers: must be an integer, got '4'"),
        ('arch = "llama"\nseed = true', "seed: must be an integer, got True"),
        ('arch = "bert"\nseed = 0', "arch 'bert': one of gpt2, llama"),
        ('arch = "gpt2"\nseed = 0\nhidden = 100\nheads = 3', "not a multiple of heads 3"),
        ('arch = "gpt2"\nseed = 0\ndtype = "int8"', "dtype 'int8'"),
        ("arch = ", "is not valid TOML"),
    ],
)
def test_a_bad_recipe_names_its_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    folder = tmp_path / "models" / "m" / "1"
    folder.mkdir(parents=True)
    (folder / RECIPE).write_text(text + "\n")
    with pytest.raises(RecipeError, match=r"^models/m/1/lm-build\.toml: ") as raised:
        read_recipe("m", folder)
    assert message in str(raised.value)


def test_only_the_served_models_are_built(tmp_path: Path) -> None:
    root = shipped_copy(tmp_path / "models")
    said: list[str] = []
    assert build_missing(root, ["minilm", "tiny-llama"], said.append)
    assert len(said) == 1
    assert said[0].startswith("built tiny-llama version 1 in ")
    assert said[0].endswith(
        "a llama-shaped model with random weights, so the text it generates is noise"
    )
    assert [v.unbuilt() for v in built_versions(root)] == ["its files are not built yet", None]
    said.clear()
    assert build_missing(root, ["tiny-llama"], said.append)
    assert said == []  # built already: nothing to say


def test_ferry_up_builds_a_served_model_before_it_checks_the_repository(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = shipped_copy(tmp_path / "models")
    # A model that is not there stops it after the build, before anything starts.
    settings = Settings(model_repository=root, models="tiny-llama,nowhere", data_dir=tmp_path)
    assert up(settings) == 2
    out = capsys.readouterr().out
    assert "built tiny-llama version 1 in " in out and "noise" in out
    assert "has no model 'nowhere'" in out and "cannot be served; not starting" in out
    assert read_recipe("tiny-llama", root / "tiny-llama" / "1").unbuilt() is None
    assert not (tmp_path / "redis").exists()  # nothing was started

    (root / "tiny-gpt2" / "1" / RECIPE).write_text('arch = "gpt2"\n')
    settings = Settings(model_repository=root, models="tiny-gpt2", data_dir=tmp_path)
    assert up(settings) == 2
    out = capsys.readouterr().out
    assert "error: models/tiny-gpt2/1/lm-build.toml: seed: is required" in out
    assert "a served model's files cannot be built; not starting" in out


def test_models_check_names_what_is_missing_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = shipped_copy(tmp_path / "models")
    assert main(["models", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert "error: models/tiny-llama/1: config.json is missing" in out
    assert (
        "tiny-llama version 1 is built from models/tiny-llama/1/lm-build.toml, and its files "
        f"are not built yet: `ferry models build tiny-llama --repository {root}` builds it"
    ) in out

    assert main(["models", "build", "tiny-llama", "--repository", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny-llama version 1: built in ")
    assert "the text it generates is noise" in out
    assert main(["models", "build", "--repository", str(root)]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama version 1: built already" in out
    assert "tiny-gpt2 version 1: built in " in out
    assert main(["models", "build", "tiny-bert", "--repository", str(root)]) == 1
    assert "has no model built from a recipe named tiny-bert" in capsys.readouterr().out
    assert main(["models", "check", str(root)]) == 0
    assert "ready to serve" in capsys.readouterr().out
