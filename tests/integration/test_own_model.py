"""A team's own models, written only in a repository folder, served by the real stack.

The repository is built here: the text-stats example (a python class), a
python model with two versions, and a TorchScript file this test saves. The
API and the workers run on it with the real Redis and database; outputs are
checked against the models themselves, and every job names its version.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.models.repository import RepositoryError
from tests.integration.conftest import RunningLoop, submit, wait_terminal
from workers.gpu.main import build_loop

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"

SCALER = """
name = "scaler"
backend = "python"
description = "Multiplies numbers: version 1 by 2, version 2 by 3."
active_version = 2

[input]
kind = "json"
[input.schema]
type = "number"

[cost]
function = "constant"

[instances]
device = "cpu"

[parameters]
class = "scale:Scale"
offset = 0.5
"""

SCALE_PY = """
from pathlib import Path
from typing import Any


class Scale:
    def __init__(self, files: Path, parameters: dict[str, Any], device: str) -> None:
        self.factor = float((files / "factor.txt").read_text())
        self.offset = parameters["offset"]
        self.device = device

    def predict(self, inputs: list[float]) -> list[dict[str, Any]]:
        return [{"y": x * self.factor + self.offset, "batch": len(inputs)} for x in inputs]
"""

AFFINE = """
name = "affine"
backend = "torchscript"

[input]
kind = "tensor"
[[input.tensors]]
name = "x"
shape = [3]
dtype = "float32"

[cost]
function = "constant"
"""


def build_repository(root: Path) -> torch.nn.Module:
    shutil.copytree(EXAMPLES / "text-stats", root / "text-stats")
    scaler = root / "scaler"
    for version, factor in ((1, 2), (2, 3)):
        folder = scaler / str(version)
        folder.mkdir(parents=True)
        (folder / "scale.py").write_text(textwrap.dedent(SCALE_PY))
        (folder / "factor.txt").write_text(str(factor))
    (scaler / "model.toml").write_text(SCALER)
    (root / "affine" / "1").mkdir(parents=True)
    (root / "affine" / "model.toml").write_text(AFFINE)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh()).eval()
    torch.jit.save(torch.jit.script(module), str(root / "affine" / "1" / "model.pt"))
    return module


@pytest.fixture
def own(settings: Settings, tmp_path: Path) -> tuple[Settings, torch.nn.Module]:
    module = build_repository(tmp_path / "models")
    return (
        settings.model_copy(
            update={
                "model_repository": tmp_path / "models",
                "models": "text-stats,scaler,affine",
                "model_parameters": {},
                "device": "cpu",
            }
        ),
        module,
    )


@pytest.fixture
def own_client(own: tuple[Settings, torch.nn.Module]) -> Iterator[TestClient]:
    with TestClient(create_app(own[0])) as client:
        yield client


def test_models_written_only_in_the_repository_run_with_their_version_recorded(
    own: tuple[Settings, torch.nn.Module],
    own_client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
) -> None:
    settings, module = own
    texts = ["The ferry leaves. The ferry returns!", "one two two three three three"]
    vectors = [[0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [1.5, 2.5, -3.5]]
    with ExitStack() as running:
        for name in ("text-stats", "scaler", "affine"):
            running.enter_context(RunningLoop(build_loop(settings, name, name=f"w-{name}")))
        stats = [submit(own_client, auth, model="text-stats", input=t) for t in texts]
        scaled = [submit(own_client, auth, model="scaler", input=x) for x in (1, 2.5)]
        pinned = submit(own_client, auth, model="scaler@2", input=4)
        affine = [submit(own_client, auth, model="affine", input=v) for v in vectors]
        rows = wait_terminal(sessions, [*stats, *scaled, pinned, *affine], timeout=60)
    assert {r.status for r in rows.values()} == {"succeeded"}, {r.error for r in rows.values()}

    outputs: dict[str, Any] = {job: row.output for job, row in rows.items()}
    assert outputs[stats[0]] == {
        "words": 6, "sentences": 2, "characters": 36, "top_words": ["ferry", "leaves", "returns"],
    }  # fmt: skip
    assert outputs[stats[1]]["top_words"] == ["three", "two", "one"]
    # Version 2 (the active one) multiplies by 3; the class got its parameters.
    assert [outputs[j]["y"] for j in scaled] == [3.5, 8.0]
    assert outputs[pinned]["y"] == 12.5
    expected = module(torch.tensor(vectors)).tolist()
    for job, want in zip(affine, expected, strict=True):
        assert rows[job].output == pytest.approx(want, abs=1e-6)

    # Every job says which version ran it, and which one it asked for.
    assert {r.model_version for r in rows.values()} == {1, 2}
    assert [rows[j].model_version for j in scaled] == [2, 2]
    assert (rows[pinned].requested_version, rows[scaled[0]].requested_version) == (2, None)
    resource = own_client.get(f"/v1/jobs/{pinned}", headers=auth).json()
    assert (resource["model"], resource["model_version"], resource["requested_version"]) == (
        "scaler", 2, 2,
    )  # fmt: skip


def test_the_catalog_shows_versions_and_refuses_unknown_ones(
    own_client: TestClient, auth: dict[str, str]
) -> None:
    models = {m["name"]: m for m in own_client.get("/v1/models", headers=auth).json()["data"]}
    assert set(models) == {"text-stats", "scaler", "affine"}
    assert models["scaler"]["backend"] == "python"
    assert models["scaler"]["version"] == 2
    # No worker runs here: both versions are only in the repository; 2 is the active one.
    assert [(v["version"], v["active"], v["state"]) for v in models["scaler"]["versions"]] == [
        (1, False, "available"), (2, True, "available"),
    ]  # fmt: skip
    assert models["affine"]["input_schema"]["items"]["type"] == "number"
    for body, message in [
        ({"model": "nope", "input": 1}, "model: unknown model 'nope'"),
        ({"model": "scaler@9", "input": 1}, "version: scaler has no version 9 (versions: 1, 2)"),
        ({"model": "scaler", "version": 9, "input": 1}, "version: scaler has no version 9"),
        ({"model": "scaler@x", "input": 1}, "model: 'scaler@x' must be 'name' or 'name@N'"),
        ({"model": "scaler@²", "input": 1}, "model: 'scaler@²' must be 'name' or 'name@N'"),
        ({"model": "scaler@02", "input": 1}, "model: 'scaler@02' must be 'name' or 'name@N'"),
        ({"model": "scaler@2", "version": 1, "input": 1}, "version: 1 differs from"),
        ({"model": "scaler@1", "input": 1}, "version: scaler@1 takes no jobs; its active"),
        ({"model": "scaler", "input": "three"}, "input: must be a number, got string"),
        ({"model": "affine", "input": [1, 2]}, "input: must be an array of shape [3]"),
        ({"model": "affine", "input": [1, 2, "x"]}, "must hold finite numbers (float32)"),
    ]:
        response = own_client.post("/v1/jobs", json=body, headers=auth)
        assert response.status_code == 422, (body, response.text)
        assert message in response.json()["error"]["message"], (body, response.text)


def test_an_invalid_repository_stops_the_api_and_a_broken_version_the_worker(
    own: tuple[Settings, torch.nn.Module], tmp_path: Path, auth: dict[str, str]
) -> None:
    settings, _module = own
    (tmp_path / "models" / "affine" / "1" / "model.pt").unlink()
    with pytest.raises(RepositoryError, match=r"models/affine/1: .*model\.pt is missing"):
        create_app(settings)
    with pytest.raises(RepositoryError, match=r"model\.pt is missing"):
        build_loop(settings, "affine")
    # A model that is not served does not stop the others; it takes no jobs, they do.
    others = create_app(settings.model_copy(update={"models": "text-stats,scaler"}))
    with TestClient(others) as client:
        models = {m["name"] for m in client.get("/v1/models", headers=auth).json()["data"]}
        assert models == {"text-stats", "scaler"}
        refused = client.post("/v1/jobs", json={"model": "affine", "input": [1, 2, 3]},
                              headers=auth)  # fmt: skip
        assert refused.status_code == 422 and "unknown model 'affine'" in refused.text


def test_a_backfill_runs_on_the_active_version_and_says_so(
    own_client: TestClient, auth: dict[str, str]
) -> None:
    body = b'{"custom_id": "a", "input": 1}\n'
    headers = auth | {"Content-Type": "application/x-ndjson"}
    refused = own_client.post("/v1/backfills?model=scaler@2", content=body, headers=headers)
    assert refused.status_code == 422
    assert "a backfill runs on the model's active version" in refused.text
    accepted = own_client.post("/v1/backfills?model=scaler", content=body, headers=headers)
    assert accepted.status_code == 202, accepted.text


def test_each_version_imports_its_own_helpers(tmp_path: Path) -> None:
    from backends import get_backend
    from backends.base import RuntimeOptions
    from core.models.reader import load_repository

    model = tmp_path / "models" / "helped"
    for version in (1, 2):
        folder = model / str(version)
        folder.mkdir(parents=True)
        (folder / "helpers.py").write_text(f"FACTOR = {version * 10}\n")
        (folder / "model.py").write_text(
            "import helpers\n\n\nclass M:\n"
            "    def __init__(self, files, parameters, device):\n        pass\n\n"
            "    def predict(self, inputs):\n"
            "        return [x * helpers.FACTOR for x in inputs]\n"
        )
    (model / "model.toml").write_text(
        'backend = "python"\n[input]\nkind = "json"\n[cost]\nfunction = "constant"\n'
        '[parameters]\nclass = "model:M"\n'
    )
    config = load_repository(tmp_path / "models", environ={})["helped"]
    backend = get_backend("python")
    outputs = []
    for version in (1, 2):
        runtime = backend.runtime(config, config.version(version), RuntimeOptions(device="cpu"))
        runtime.load()
        outputs.append(runtime.run([1, 2]))
    assert outputs == [[10, 20], [20, 40]]
