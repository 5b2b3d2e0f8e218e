"""The inference protocol's gRPC form through the real ``tritonclient.grpc`` on real workers.

The API serves ``inference.GRPCInferenceService`` beside HTTP (``FERRY_GRPC_PORT``);
what the REST routes mean (tests/integration/test_oip.py), the gRPC calls mean too:
the same jobs, lanes, deadlines, errors (as gRPC codes) and repository actions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.oip.third_party import grpc_service_pb2 as pb
from api.oip.third_party import grpc_service_pb2_grpc as pb_grpc
from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import Job, ModelUnload
from harness import webclient
from harness.ports import free_port
from harness.served import Served, served
from tests.integration.conftest import RunningLoop, build_sim_loop
from tests.integration.test_hot_reload import echo_repository, wait_until
from tests.integration.test_oip import (
    TEXTS,
    assert_bad_inputs_refused,
    assert_lanes_and_deadlines,
    assert_minilm_embeddings,
    refused,
    wait_ready,
)
from workers.gpu.main import build_loop

# The database is not this module's subject: it runs on PostgreSQL only.
pytestmark = pytest.mark.one_database("postgresql")


@pytest.fixture
def api(settings: Settings) -> Iterator[Served]:
    with served(settings, grpc_port=free_port()) as running:
        yield running


def grpc_port(api: Served) -> int:
    return api.settings.grpc_port


@pytest.fixture
def client(api: Served) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(f"127.0.0.1:{grpc_port(api)}") as client:
        yield client


@pytest.fixture
def headers(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def sim(
    settings: Settings, client: triton.InferenceServerClient, headers: dict[str, str]
) -> Iterator[None]:
    with RunningLoop(build_sim_loop(settings, name="grpc-sim")):
        wait_ready(client, "sim", headers)
        yield


def texts_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


def json_input(documents: list[object]) -> triton.InferInput:
    tensor = triton.InferInput("input", [len(documents)], "BYTES")
    tensor.set_data_from_numpy(np.array([json.dumps(d).encode() for d in documents], dtype=object))
    return tensor


def test_health_and_metadata_over_grpc(
    client: triton.InferenceServerClient, headers: dict[str, str]
) -> None:
    # Health needs no key, as over HTTP.
    assert client.is_server_live() and client.is_server_ready()
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "ferry"
    assert {"binary_tensor_data", "async", "model_repository"} <= set(server["extensions"])
    minilm = client.get_model_metadata("minilm", headers=headers, as_json=True)
    assert minilm["versions"] == ["1"] and minilm["platform"].startswith("ferry_")
    assert minilm["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
    assert minilm["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": ["-1", "384"]}]
    unknown = refused(lambda: client.get_model_metadata("bert-large", headers=headers))
    assert unknown.status() == "StatusCode.NOT_FOUND"
    assert "unknown model 'bert-large'" in unknown.message()
    no_key = refused(lambda: client.get_model_metadata("minilm"))
    assert no_key.status() == "StatusCode.UNAUTHENTICATED"
    assert "missing Authorization header" in no_key.message()
    bad_key = refused(lambda: client.get_model_metadata("minilm", headers={"authorization": "x"}))
    assert bad_key.status() == "StatusCode.UNAUTHENTICATED"
    # A model no worker serves is not ready; that is an answer, not an error.
    assert not client.is_model_ready("sim", headers=headers)


def test_minilm_over_grpc_agrees_with_the_model_run_directly(
    settings: Settings, client: triton.InferenceServerClient, headers: dict[str, str]
) -> None:
    with RunningLoop(build_loop(settings, "minilm", name="grpc-minilm")):
        wait_ready(client, "minilm", headers)
        result = client.infer("minilm", [texts_input(TEXTS)], headers=headers, request_id="g-1")
    response = result.get_response(as_json=True)
    assert response["id"] == "g-1" and response["model_version"] == "1"
    assert_minilm_embeddings(result.as_numpy("embedding"))


def test_typed_contents_and_raw_contents_make_the_same_jobs(
    api: Served,
    headers: dict[str, str],
    sim: None,
    sessions: sessionmaker[Session],
) -> None:
    # tritonclient always sends raw_input_contents; other clients send typed contents.
    documents = [{"cost": 3}, {"cost": 40}]
    request = pb.ModelInferRequest(model_name="sim", id="typed")
    tensor = request.inputs.add(name="input", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend(json.dumps(d).encode() for d in documents)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port(api)}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = tuple(headers.items())
        response = stub.ModelInfer(request, metadata=metadata, timeout=30)
        assert response.id == "typed" and response.model_version == "1"
        (output,) = response.outputs
        assert (output.name, output.datatype, list(output.shape)) == ("output", "BYTES", [2])
        # A count that does not match the shape is refused before any job is made.
        short = pb.ModelInferRequest(model_name="sim", id="short")
        short.inputs.add(name="input", datatype="BYTES", shape=[3]).contents.bytes_contents.append(
            b"{}"
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(short, metadata=metadata, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "input 'input': shape [3] holds 3 elements, contents has 1"
    with sessions() as session:
        jobs = session.scalars(select(Job)).all()
    typed = [j for j in jobs if (j.metadata_ or {}).get("request_id") == "typed"]
    assert sorted(j.input["cost"] for j in typed) == [3, 40]
    assert all(j.status == "succeeded" for j in typed)
    assert not [j for j in jobs if (j.metadata_ or {}).get("request_id") == "short"]


def test_priority_and_timeout_over_grpc_become_the_lane_and_the_deadline(
    client: triton.InferenceServerClient,
    headers: dict[str, str],
    sim: None,
    sessions: sessionmaker[Session],
) -> None:
    jobs = assert_lanes_and_deadlines(client, headers, sessions, json_input, "g")
    for priority, job in jobs.items():
        assert job.metadata_ == {"protocol": "v2", "request_id": f"g{priority}"}


def test_each_error_is_a_grpc_status_with_the_rest_message(
    client: triton.InferenceServerClient, headers: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        before = len(session.scalars(select(Job.id)).all())
    invalid = "StatusCode.INVALID_ARGUMENT"
    assert_bad_inputs_refused(client, headers, triton, texts_input, "StatusCode.NOT_FOUND", invalid)
    bad_version = refused(
        lambda: client.infer("minilm", [texts_input(["x"])], model_version="v2", headers=headers)
    )
    assert bad_version.status() == invalid
    assert bad_version.message() == "version 'v2' is not a version number (1 or more)"
    no_key = refused(lambda: client.infer("minilm", [texts_input(["x"])]))
    assert no_key.status() == "StatusCode.UNAUTHENTICATED"
    # Calls Ferry does not serve say so.
    config = refused(lambda: client.get_model_config("minilm", headers=headers))
    assert config.status() == "StatusCode.UNIMPLEMENTED"
    with sessions() as session:
        assert len(session.scalars(select(Job.id)).all()) == before  # none made a job


def test_async_over_grpc_answers_with_jobs_the_job_api_reads(
    api: Served,
    client: triton.InferenceServerClient,
    headers: dict[str, str],
    sim: None,
    make_token: Callable[[str], str],
) -> None:
    result = client.infer(
        "sim", [json_input([{"cost": 5}, {"cost": 6}])], headers=headers, request_id="later",
        parameters={"async": True},
    )  # fmt: skip
    response = result.get_response()
    assert response.id == "later" and not response.outputs
    ids = response.parameters["job_ids"].string_param.split(",")
    assert len(ids) == 2
    rest = {"Authorization": headers["authorization"]}
    with webclient.client(base_url=api.base, headers=rest, timeout=30) as http:
        for job_id in ids:
            done = http.get(f"/v1/jobs/{job_id}", params={"wait": 10}).json()
            assert done["status"] == "succeeded" and done["id"] == job_id
        stranger = {"Authorization": f"Bearer {make_token('stranger')}"}
        assert http.get(f"/v1/jobs/{ids[0]}", headers=stranger).status_code == 404


def test_the_repository_over_grpc_lists_unloads_and_loads_for_admin_keys_only(
    settings: Settings,
    tmp_path: Path,
    headers: dict[str, str],
    sessions: sessionmaker[Session],
) -> None:
    root = tmp_path / "models"
    echo_repository(root)
    with sessions() as session:
        admin = {"authorization": f"Bearer {create_key(session, 'ops', 'admin').token}"}
    changes = {
        "model_repository": root,
        "models": "echo",
        "model_parameters": {},
        "model_poll_s": 0.2,
        "device": "cpu",
        "grpc_port": free_port(),
    }
    with served(settings, **changes) as api:
        client = triton.InferenceServerClient(f"127.0.0.1:{changes['grpc_port']}")
        try:
            index = client.get_model_repository_index(headers=admin, as_json=True)
            assert [(m["name"], m["version"], m["state"]) for m in index["models"]] == [
                ("echo", "1", "UNAVAILABLE"),
                ("echo", "2", "UNAVAILABLE"),
            ]
            denied = refused(lambda: client.get_model_repository_index(headers=headers))
            assert denied.status() == "StatusCode.PERMISSION_DENIED"
            denied = refused(lambda: client.unload_model("echo", headers=headers))
            assert denied.status() == "StatusCode.PERMISSION_DENIED"
            client.unload_model("echo", headers=admin)
            with sessions() as session:
                assert session.scalars(select(ModelUnload.model)).all() == ["echo"]
            unloaded = refused(lambda: client.infer("echo", [json_input([1])], headers=headers))
            assert unloaded.status() == "StatusCode.INVALID_ARGUMENT"
            assert unloaded.message() == (
                "model: 'echo' is unloaded: it takes no new jobs until an operator loads it "
                "(POST /v2/repository/models/echo/load)"
            )
            config = refused(lambda: client.load_model("echo", headers=admin, config="{}"))
            assert config.status() == "StatusCode.INVALID_ARGUMENT"
            assert "parameters.config" in config.message()
            client.load_model("echo", headers=admin)
            with sessions() as session:
                assert session.scalars(select(ModelUnload.model)).all() == []
            with RunningLoop(build_loop(api.settings, "echo", name="grpc-echo")):
                wait_until(lambda: client.is_model_ready("echo", headers=headers))
                result = client.infer("echo", [json_input([7])], headers=headers)
                assert [json.loads(x) for x in result.as_numpy("output")] == [{"v": 1, "x": 7}]
        finally:
            client.close()
