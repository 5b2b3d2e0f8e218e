"""/v2, the Open Inference Protocol, through the real ``tritonclient`` package on real workers."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import numpy as np
import pytest
import tritonclient.http as triton
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from tritonclient.utils import InferenceServerException

from core.config.settings import Settings
from core.db.schema import Job
from harness import webclient
from harness.served import Served
from tests.integration.conftest import RunningLoop, build_sim_loop
from tests.models import runtime
from tests.vectors import cosine
from workers.gpu.main import build_loop

# The database is not this module's subject: it runs on PostgreSQL only.
pytestmark = pytest.mark.one_database("postgresql")

TEXTS = [
    "A cat sits on the mat.",
    "Trains leave on the hour.",
    "Quarterly tax filing deadlines are near.",
    "Der Zug fährt um acht Uhr ab.",
]


def http_client(api: Served) -> triton.InferenceServerClient:
    """Triton's HTTP client of the served API (closed by its ``with``)."""
    return triton.InferenceServerClient(api.base.removeprefix("http://"), network_timeout=30)


@pytest.fixture
def client(api: Served) -> Iterator[triton.InferenceServerClient]:
    with http_client(api) as client:
        yield client


@pytest.fixture
def headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def sim(
    settings: Settings, client: triton.InferenceServerClient, headers: dict[str, str]
) -> Iterator[None]:
    with RunningLoop(build_sim_loop(settings, name="oip-sim")):
        # Loaded first: an answer's wait (FERRY_MAX_WAIT_S) is not for a model's load.
        wait_ready(client, "sim", headers)
        yield


@pytest.fixture
def minilm(
    settings: Settings, client: triton.InferenceServerClient, headers: dict[str, str]
) -> Iterator[None]:
    with RunningLoop(build_loop(settings, "minilm", name="oip-minilm")):
        wait_ready(client, "minilm", headers)
        yield


def texts_input(texts: list[str], binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object), binary)
    return tensor


def json_input(documents: Sequence[object], binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("input", [len(documents)], "BYTES")
    encoded = [json.dumps(d).encode() for d in documents]
    tensor.set_data_from_numpy(np.array(encoded, dtype=object), binary)
    return tensor


def test_the_server_is_live_ready_and_says_what_it_speaks(
    client: triton.InferenceServerClient,
) -> None:
    # Health needs no key: probes carry none.
    assert client.is_server_live() and client.is_server_ready()
    found = client.get_server_metadata()
    assert found["name"] == "ferry"
    assert {"binary_tensor_data", "async"} <= set(found["extensions"])


def test_model_metadata_names_the_tensors(
    client: triton.InferenceServerClient, headers: dict[str, str]
) -> None:
    minilm = client.get_model_metadata("minilm", headers=headers)
    assert minilm["name"] == "minilm" and minilm["versions"] == ["1"]
    assert minilm["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert minilm["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    sim = client.get_model_metadata("sim", model_version="1", headers=headers)
    assert sim["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
    assert sim["outputs"] == [{"name": "output", "datatype": "BYTES", "shape": [-1]}]
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("bert-large", headers=headers)
    assert (
        unknown.value.status() == "404" and "unknown model 'bert-large'" in unknown.value.message()
    )


def test_a_model_is_ready_once_a_worker_serves_it(
    client: triton.InferenceServerClient, headers: dict[str, str], settings: Settings
) -> None:
    assert not client.is_model_ready("sim", headers=headers)
    with RunningLoop(build_sim_loop(settings, name="oip-ready")):
        wait_ready(client, "sim", headers)
        assert client.is_model_ready("sim", model_version="1", headers=headers)


def wait_ready(client: triton.InferenceServerClient, model: str, headers: dict[str, str]) -> None:
    deadline = time.monotonic() + 120  # only a hang gets there
    while not client.is_model_ready(model, headers=headers):
        assert time.monotonic() < deadline, f"a running {model} worker never made it ready"
        time.sleep(0.1)


def assert_minilm_embeddings(got: np.ndarray | None) -> None:
    """``got``, minilm's embeddings of TEXTS, agree row by row with the model run directly."""
    assert got is not None and got.shape == (4, 384) and got.dtype == np.float32
    direct = runtime("minilm").run(TEXTS)
    for row, expected in zip(got, direct, strict=True):
        assert cosine(row.tolist(), expected) >= 0.999
    assert cosine(got[0].tolist(), got[1].tolist()) < 0.99  # rows are not mixed up


def test_minilm_in_binary_agrees_with_the_model_run_directly(
    client: triton.InferenceServerClient, headers: dict[str, str], minilm: None
) -> None:
    result = client.infer("minilm", [texts_input(TEXTS)], headers=headers, request_id="r-17")
    assert result.get_response()["id"] == "r-17"
    assert result.get_response()["model_version"] == "1"
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 4 * 384 * 4
    assert_minilm_embeddings(result.as_numpy("embedding"))


def test_json_tensors_in_and_out_on_sim(
    client: triton.InferenceServerClient,
    headers: dict[str, str],
    sim: None,
    sessions: sessionmaker[Session],
) -> None:
    output = triton.InferRequestedOutput("output", binary_data=False)
    documents = [{"cost": 3}, {"cost": 40}, {"cost": 7}]
    result = client.infer(
        "sim", [json_input(documents, binary=False)], outputs=[output], headers=headers,
        request_id="sim-json",
    )  # fmt: skip
    tensor = result.get_response()["outputs"][0]
    assert tensor["shape"] == [3] and "parameters" not in tensor  # JSON, as asked
    assert result.get_response()["model_version"] == "1"  # the version that ran the rows
    answers = [json.loads(item) for item in result.as_numpy("output")]
    with sessions() as session:
        jobs = session.scalars(select(Job).order_by(Job.created_at)).all()
    mine = [job for job in jobs if (job.metadata_ or {}).get("request_id") == "sim-json"]
    assert [job.input for job in mine] == documents
    # Row by row, each job's own output.
    assert sorted(map(json.dumps, answers)) == sorted(json.dumps(job.output) for job in mine)


def assert_lanes_and_deadlines(
    client: triton.InferenceServerClient,
    headers: dict[str, str],
    sessions: sessionmaker[Session],
    documents_input: Callable[[list[object]], triton.InferInput],
    prefix: str,
) -> dict[int, Job]:
    """An inference on sim at each priority with a timeout of 9 s (in microseconds), request
    id ``prefix`` and the priority, over tritonclient's HTTP or gRPC client: each job is in
    the priority's lane, its deadline 9 s after it was made. The jobs by priority."""
    jobs_by_priority: dict[int, Job] = {}
    for priority, lane in ((1, "urgent"), (2, "vip"), (0, "normal"), (7, "bulk")):
        client.infer(
            "sim", [documents_input([{"cost": 2}])], headers=headers, priority=priority,
            timeout=9_000_000, request_id=f"{prefix}{priority}",
        )  # fmt: skip
        with sessions() as session:
            jobs = session.scalars(select(Job)).all()
        (job,) = [j for j in jobs if (j.metadata_ or {}).get("request_id") == f"{prefix}{priority}"]
        assert job.priority == lane and job.status == "succeeded"
        assert job.deadline_at is not None
        allowed_ms = (job.deadline_at - job.created_at).total_seconds() * 1000
        assert allowed_ms == pytest.approx(9_000, abs=5)
        jobs_by_priority[priority] = job
    return jobs_by_priority


def test_priority_and_timeout_become_the_lane_and_the_deadline(
    client: triton.InferenceServerClient,
    headers: dict[str, str],
    sim: None,
    sessions: sessionmaker[Session],
) -> None:
    assert_lanes_and_deadlines(client, headers, sessions, json_input, "p")


def refused(call: Callable[[], object]) -> InferenceServerException:
    """What ``call``, which tritonclient (HTTP or gRPC) must refuse, raised."""
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def assert_bad_inputs_refused(
    client: triton.InferenceServerClient,
    headers: dict[str, str],
    protocol: ModuleType,
    texts: Callable[[list[str]], triton.InferInput],
    not_found: str,
    invalid: str,
) -> None:
    """Bad inputs for minilm over tritonclient's HTTP or gRPC client (``protocol`` the
    module, ``texts`` its maker of a texts tensor): each refused with why, and the status
    of its kind as the protocol says it (``not_found`` or ``invalid``)."""

    def infer(*inputs: triton.InferInput, model: str = "minilm") -> InferenceServerException:
        return refused(lambda: client.infer(model, list(inputs), headers=headers))

    unknown = infer(texts(["x"]), model="bert-large")
    assert unknown.status() == not_found and "unknown model" in unknown.message()
    floats = protocol.InferInput("text", [1], "FP32")
    floats.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    wrong_type = infer(floats)
    assert wrong_type.status() == invalid
    assert wrong_type.message() == "input 'text': datatype FP32, the model takes BYTES"
    wide = protocol.InferInput("text", [1, 2], "BYTES")
    wide.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=object))
    assert "shape [1, 2], the model takes [N] or [N, 1]" in infer(wide).message()
    other = protocol.InferInput("sentence", [1], "BYTES")
    other.set_data_from_numpy(np.array([b"a"], dtype=object))
    assert "has no such input" in infer(other).message()
    too_long = infer(texts(["word " * 5000]))
    assert too_long.status() == invalid and too_long.message().startswith("row 0: input")


def test_each_error_is_the_protocols(
    client: triton.InferenceServerClient, headers: dict[str, str]
) -> None:
    assert_bad_inputs_refused(client, headers, triton, texts_input, "404", "400")
    with pytest.raises(InferenceServerException) as no_key:
        client.infer("minilm", [texts_input(["x"])])
    assert no_key.value.status() == "401"


def test_the_async_extension_answers_202_with_jobs_the_job_api_reads(
    api: Served, headers: dict[str, str], sim: None, make_token: Callable[[str], str]
) -> None:
    body = {
        "id": "later",
        "parameters": {"async": True},
        "inputs": [{"name": "input", "datatype": "BYTES", "shape": [2],
                    "data": ['{"cost": 5}', '{"cost": 6}']}],
    }  # fmt: skip
    with webclient.client(base_url=api.base, headers=headers, timeout=30) as http:
        accepted = http.post("/v2/models/sim/infer", json=body)
        assert accepted.status_code == 202, accepted.text
        answer = accepted.json()
        assert answer["id"] == "later" and len(answer["jobs"]) == 2
        for job in answer["jobs"]:
            done = http.get(job["location"], params={"wait": 10}).json()
            assert done["status"] == "succeeded" and done["id"] == job["id"]
        # Another tenant's key cannot read them.
        stranger = {"Authorization": f"Bearer {make_token('stranger')}"}
        assert http.get(answer["jobs"][0]["location"], headers=stranger).status_code == 404
        bad = http.post("/v2/models/sim/infer", content=b"{not json")
        assert bad.status_code == 400 and bad.json() == {
            "error": "the request's header is not valid JSON"
        }


def jpeg(colour: tuple[int, int, int], size: tuple[int, int] = (96, 64)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_an_image_model_takes_the_files_bytes_in_binary(
    client: triton.InferenceServerClient,
    api: Served,
    headers: dict[str, str],
    settings: Settings,
    sessions: sessionmaker[Session],
) -> None:
    images = [jpeg((200, 30, 30)), jpeg((20, 40, 220), (64, 128))]
    tensor = triton.InferInput("image", [2], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object))  # binary: the files' own bytes
    with RunningLoop(build_loop(settings, "resnet50", name="oip-resnet50")):
        wait_ready(client, "resnet50", headers)
        # (tritonclient adds its own headers to the dict it is given: a copy.)
        result = client.infer("resnet50", [tensor], headers=dict(headers))
        # The first file again as a UINT8 row, as Triton's image pipelines send a file.
        as_uint8 = triton.InferInput("image", [1, len(images[0])], "UINT8")
        as_uint8.set_data_from_numpy(np.frombuffer(images[0], dtype=np.uint8).reshape(1, -1))
        again = client.infer("resnet50", [as_uint8], headers=dict(headers))
        # The same files as Ferry's own jobs (base64 in JSON): the same answers.
        with webclient.client(base_url=api.base, headers=headers, timeout=30) as http:
            direct = [
                http.post(
                    "/v1/jobs",
                    params={"wait": 10},
                    json={"model": "resnet50", "input": base64.b64encode(image).decode()},
                ).json()
                for image in images
            ]
    # Each file reached its job intact, as the job API's base64 would carry it.
    with sessions() as session:
        jobs = session.scalars(select(Job).where(Job.model == "resnet50")).all()
    via_protocol = [job for job in jobs if (job.metadata_ or {}).get("protocol") == "v2"]
    encoded = [base64.b64encode(image).decode() for image in images]
    assert sorted(job.input for job in via_protocol) == sorted([*encoded, encoded[0]])
    # The same answers, up to the float noise of running in batches of other sizes.
    answers = [json.loads(item) for item in result.as_numpy("output")]
    assert [job["status"] for job in direct] == ["succeeded", "succeeded"]
    for ours, theirs in zip(answers, [job["output"] for job in direct], strict=True):
        assert [c["class"] for c in ours["top5"][:3]] == [c["class"] for c in theirs["top5"][:3]]
        scores = {c["class"]: c["score"] for c in theirs["top5"]}
        for found in ours["top5"]:
            if found["class"] in scores:
                assert found["score"] == pytest.approx(scores[found["class"]], abs=1e-4)
    assert answers[0]["top5"] != answers[1]["top5"]
    (uint8_answer,) = [json.loads(item) for item in again.as_numpy("output")]
    assert [c["class"] for c in uint8_answer["top5"][:3]] == [
        c["class"] for c in answers[0]["top5"][:3]
    ]


def test_values_ferry_cannot_keep_are_400s_and_make_no_job(
    api: Served, headers: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    def one(document: str = '{"cost": 1}', **extra: object) -> dict[str, object]:
        tensor = {"name": "input", "datatype": "BYTES", "shape": [1], "data": [document]}
        return {"inputs": [tensor], **extra}

    with sessions() as session:
        before = len(session.scalars(select(Job.id)).all())
    with webclient.client(base_url=api.base, headers=headers, timeout=30) as http:
        for body, said in (
            (one(id="a\u0000b"), "id must not contain NUL characters"),
            (one(parameters={"timeout": 10**15}), "parameters.timeout: at most"),
            (one('"a\\u0000b"'), "row 0: input: must not contain NUL characters"),
            # Refused before its job is made, not once the job has run.
            (one(outputs=[{"name": "logits"}]), "output 'logits': no such output"),
        ):
            answer = http.post("/v2/models/sim/infer", json=body)
            assert answer.status_code == 400, answer.text
            assert said in answer.json()["error"]
    with sessions() as session:
        assert len(session.scalars(select(Job.id)).all()) == before
