"""/v2/repository, the inference protocol's model repository extension, through the real
``tritonclient``: the index of every model version, unload and load as Ferry's activation.

On both databases: an unload and a load are rows the API reads back (model_unloads,
model_activations). The repository is built here: echo (versions 1 and 2, each
answering with its number) and a model whose files have a problem, which is not served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tritonclient.http as triton
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from tritonclient.utils import InferenceServerException

from core.config.settings import Settings
from core.db.schema import ModelActivation, ModelUnload
from harness import webclient
from harness.served import Served, served
from tests.integration.conftest import RunningLoop
from tests.integration.test_hot_reload import ECHO, echo_repository, wait_until
from tests.integration.test_oip import http_client, json_input, refused
from workers.gpu.main import build_loop

Entry = dict[str, str]


@pytest.fixture
def repository_settings(settings: Settings, tmp_path: Path) -> Settings:
    root = tmp_path / "models"
    echo_repository(root)
    broken = root / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "model.toml").write_text(
        ECHO.replace('"echo"', '"broken"').replace("echo:Echo", "missing:Nope")
    )
    return settings.model_copy(
        update={
            "model_repository": root,
            "models": "echo",
            "model_parameters": {},
            "model_poll_s": 0.2,
            "device": "cpu",
        }
    )


@pytest.fixture
def api(repository_settings: Settings) -> Iterator[Served]:
    with served(repository_settings) as running:
        yield running


@pytest.fixture
def client(api: Served) -> Iterator[triton.InferenceServerClient]:
    with http_client(api) as client:
        yield client


@pytest.fixture
def echo(repository_settings: Settings) -> Iterator[None]:
    with RunningLoop(build_loop(repository_settings, "echo", name="oip-echo")):
        yield


def index(client: triton.InferenceServerClient, admin: dict[str, str]) -> dict[str, Entry]:
    """The index by "name/version"; tritonclient adds to the headers it is given: a copy."""
    entries = client.get_model_repository_index(headers=dict(admin))
    return {f"{e['name']}/{e['version']}": e for e in entries}


def state(client: triton.InferenceServerClient, admin: dict[str, str], which: str) -> str:
    return index(client, admin)[which]["state"]


def recorded(sessions: sessionmaker[Session], column: Any) -> list[Any]:
    """What the database holds in ``column``: the operators' unloads and activations."""
    with sessions() as session:
        return list(session.scalars(select(column)).all())


def infer_echo(client: triton.InferenceServerClient, headers: dict[str, str], x: int) -> Any:
    result = client.infer("echo", [json_input([x])], headers=dict(headers))
    (answer,) = result.as_numpy("output")
    return json.loads(answer)


def test_the_index_lists_every_version_and_its_state(
    api: Served,
    client: triton.InferenceServerClient,
    admin: dict[str, str],
    repository_settings: Settings,
) -> None:
    assert "model_repository" in client.get_server_metadata()["extensions"]
    no_worker = "no live worker serves it (its jobs wait in the queue for one)"
    assert index(client, admin) == {
        "broken/1": {"name": "broken", "version": "1", "state": "UNAVAILABLE",
                     "reason": "not served: its files have a problem (ferry models check says "
                               "which), or it was added after the API started"},
        "echo/1": {"name": "echo", "version": "1", "state": "UNAVAILABLE", "reason": no_worker},
        "echo/2": {"name": "echo", "version": "2", "state": "UNAVAILABLE",
                   "reason": "not the active version (1 is)"},
    }  # fmt: skip
    with (
        RunningLoop(build_loop(repository_settings, "echo", name="oip-echo")),
        webclient.client(base_url=api.base, headers=admin, timeout=30) as http,
    ):
        wait_until(lambda: state(client, admin, "echo/1") == "READY")
        assert index(client, admin)["echo/1"]["reason"] == ""
        # {"ready": true}: only what is ready for inference.
        ready = http.post("/v2/repository/index", json={"ready": True})
        assert ready.status_code == 200, ready.text
        assert ready.json() == [{"name": "echo", "version": "1", "state": "READY", "reason": ""}]


def test_unload_refuses_new_jobs_and_load_takes_them_again(
    api: Served,
    client: triton.InferenceServerClient,
    admin: dict[str, str],
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    repository_settings: Settings,
) -> None:
    with webclient.client(base_url=api.base, headers=auth, timeout=30) as http:
        # Accepted before the unload (no worker yet): it runs all the same.
        before = http.post("/v1/jobs", json={"model": "echo", "input": 7})
        assert before.status_code == 202, before.text
        client.unload_model("echo", headers=dict(admin))
        client.unload_model("echo", headers=dict(admin))  # again: nothing more changes
        assert recorded(sessions, ModelUnload.model) == ["echo"]
        for version in ("1", "2"):
            entry = index(client, admin)[f"echo/{version}"]
            assert entry["state"] == "UNAVAILABLE"
            assert entry["reason"] == "unloaded: the model takes no new jobs until it is loaded"
        with RunningLoop(build_loop(repository_settings, "echo", name="oip-echo")):
            done = http.get(f"/v1/jobs/{before.json()['id']}", params={"wait": 10}).json()
            assert done["status"] == "succeeded" and done["output"] == {"v": 1, "x": 7}
            # New jobs are refused on every route, with why, and none is made.
            assert not client.is_model_ready("echo", headers=dict(auth))
            with pytest.raises(InferenceServerException) as refused:
                infer_echo(client, auth, 8)
            assert refused.value.status() == "400"
            assert refused.value.message() == (
                "model: 'echo' is unloaded: it takes no new jobs until an operator loads it "
                "(POST /v2/repository/models/echo/load)"
            )
            direct = http.post("/v1/jobs", json={"model": "echo", "input": 8})
            assert direct.status_code == 422 and "'echo' is unloaded" in direct.text
            assert len(http.get("/v1/jobs").json()["data"]) == 1
            # Its metadata is still read.
            assert client.get_model_metadata("echo", headers=dict(auth))["versions"] == [
                "1", "2",
            ]  # fmt: skip

            client.load_model("echo", headers=dict(admin))
            assert recorded(sessions, ModelUnload.model) == []
            wait_until(lambda: state(client, admin, "echo/1") == "READY")
            assert client.is_model_ready("echo", headers=dict(auth))
            assert infer_echo(client, auth, 9) == {"v": 1, "x": 9}


def test_load_with_a_version_activates_it_and_a_refused_one_changes_nothing(
    api: Served,
    client: triton.InferenceServerClient,
    admin: dict[str, str],
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    echo: None,
) -> None:
    wait_until(lambda: state(client, admin, "echo/1") == "READY")
    with webclient.client(base_url=api.base, headers=admin, timeout=30) as http:
        client.unload_model("echo", headers=dict(admin))
        # A version the repository lacks: a 400, and the model stays unloaded on version 1.
        missing = http.post("/v2/repository/models/echo/load", json={"parameters": {"version": 9}})
        assert missing.status_code == 400
        assert missing.json() == {"error": "version: echo has no version 9 (versions: 1, 2)"}
        assert state(client, admin, "echo/1") == "UNAVAILABLE"
        assert recorded(sessions, ModelUnload.model) == ["echo"]
        assert recorded(sessions, ModelActivation.version) == []

        loaded = http.post("/v2/repository/models/echo/load", json={"parameters": {"version": 2}})
        assert loaded.status_code == 200, loaded.text
        # The answer: the model's entries as the index has them now.
        first, second = loaded.json()
        assert (first["version"], first["reason"]) == ("1", "not the active version (2 is)")
        assert second["version"] == "2" and second["state"] in ("UNAVAILABLE", "LOADING", "READY")
        assert recorded(sessions, ModelActivation.version) == [2]
        # The workers follow the activation, as after POST /v1/admin/models/echo/activate.
        wait_until(lambda: state(client, admin, "echo/2") == "READY")
        assert infer_echo(client, auth, 3) == {"v": 2, "x": 3}
        # That route is the same activation.
        rolled_back = http.post("/v1/admin/models/echo/activate", json={"version": 1})
        assert rolled_back.json() == {"model": "echo", "version": 1, "previous": 2}


def test_only_admin_keys_reach_the_repository_and_bad_requests_change_nothing(
    api: Served,
    client: triton.InferenceServerClient,
    admin: dict[str, str],
    auth: dict[str, str],
    sessions: sessionmaker[Session],
) -> None:
    before = index(client, admin)
    for call in (
        lambda h: client.get_model_repository_index(headers=h),
        lambda h: client.load_model("echo", headers=h),
        lambda h: client.unload_model("echo", headers=h),
    ):
        with pytest.raises(InferenceServerException) as forbidden:
            call(dict(auth))
        assert forbidden.value.status() == "403"
        assert forbidden.value.message() == "this endpoint needs an API key with the admin scope"
        with pytest.raises(InferenceServerException) as anonymous:
            call(None)
        assert anonymous.value.status() == "401"

    for unknown in (
        refused(lambda: client.load_model("bert-large", headers=dict(admin))),
        refused(lambda: client.unload_model("bert-large", headers=dict(admin))),
    ):
        assert unknown.status() == "404"
        assert unknown.message() == "model: no model 'bert-large' is served"
    unserved = refused(lambda: client.unload_model("broken", headers=dict(admin)))
    assert unserved.status() == "400"
    assert unserved.message().startswith("model 'broken' is in the repository but not served")
    config = refused(lambda: client.load_model("echo", headers=dict(admin), config="{}"))
    assert config.status() == "400"
    assert config.message().startswith("parameters.config: Ferry serves the models of its")
    with webclient.client(base_url=api.base, headers=admin, timeout=30) as http:
        for path, body, said in (
            ("/v2/repository/index", b"{", "the request is not valid JSON"),
            ("/v2/repository/index", b'{"ready": 1}', "ready must be true or false"),
            ("/v2/repository/models/echo/unload", b'{"parameters": {"unload_dependents": "no"}}',
             "parameters.unload_dependents must be true or false"),
            ("/v2/repository/models/echo/load", b'{"parameters": {"version": "2"}}',
             "parameters.version must be an integer"),
        ):  # fmt: skip
            answer = http.post(path, content=body)
            assert answer.status_code == 400, answer.text
            assert answer.json() == {"error": said}
    assert index(client, admin) == before
    assert recorded(sessions, ModelUnload.model) == []
    assert recorded(sessions, ModelActivation.model) == []


def test_another_api_process_follows_an_unload_and_a_load_within_its_poll(
    api: Served,
    client: triton.InferenceServerClient,
    admin: dict[str, str],
    auth: dict[str, str],
    repository_settings: Settings,
) -> None:
    def status(http: httpx.Client) -> int:
        return http.post("/v1/jobs", json={"model": "echo", "input": 1}).status_code

    with (
        served(repository_settings) as other,
        webclient.client(base_url=other.base, headers=auth, timeout=30) as http,
    ):
        assert status(http) == 202  # it has read the unloads: none
        client.unload_model("echo", headers=dict(admin))
        # FERRY_MODEL_POLL_S is 0.2 s here; 5 s is only for a loaded machine.
        wait_until(lambda: status(http) == 422, timeout=5)
        client.load_model("echo", headers=dict(admin))
        wait_until(lambda: status(http) == 202, timeout=5)
