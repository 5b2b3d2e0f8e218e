"""The resnet50 runtime on the CPU: random weights say so, a weights file loads, and an
image that cannot be decoded fails alone."""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from sqlalchemy.orm import Session, sessionmaker

from backends.torchvision import TorchvisionRuntime, build_resnet50
from core.config.settings import Settings
from tests.integration.conftest import RunningLoop, submit, wait_terminal
from tests.models import runtime as shipped_runtime
from workers.gpu.execute import run_isolating
from workers.gpu.main import build_loop


def encoded(colour: tuple[int, int, int], size: tuple[int, int], fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


IMAGES = [
    encoded((250, 20, 20), (320, 200)),
    encoded((20, 250, 20), (64, 96), "JPEG"),
    encoded((20, 20, 250), (224, 224)),
]


@pytest.fixture(scope="module")
def random_runtime() -> TorchvisionRuntime:
    runtime = shipped_runtime("resnet50", overrides={"random_weights": True, "decode_threads": 2})
    assert isinstance(runtime, TorchvisionRuntime)
    return runtime


def test_random_weights_say_so_in_every_output(random_runtime: TorchvisionRuntime) -> None:
    outputs = random_runtime.run(IMAGES)
    assert len(outputs) == 3
    for output in outputs:
        assert output["weights"] == "random"
        scores = [entry["score"] for entry in output["top5"]]
        assert len(scores) == 5 and scores == sorted(scores, reverse=True)
        assert 0 < sum(scores) <= 1.0 + 1e-6
        assert all(0 <= entry["class"] < 1000 for entry in output["top5"])
    # On the CPU no stream, device memory share or pinned staging is made.
    assert (random_runtime._stream, random_runtime._memory, random_runtime.pinned_bytes) == (
        None, None, 0,
    )  # fmt: skip
    assert random_runtime.peak_memory_bytes is None


def test_weights_come_from_a_state_dict_file(
    random_runtime: TorchvisionRuntime, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    path = tmp_path / "resnet50.pth"
    torch.save(build_resnet50().state_dict(), path)
    from_file = shipped_runtime("resnet50", overrides={"weights": str(path), "decode_threads": 2})
    outputs = from_file.run(IMAGES[:2])
    assert [o["weights"] for o in outputs] == ["file", "file"]
    # The same seeded network: the same answers as the random runtime's.
    expected = random_runtime.run(IMAGES[:2])
    assert [o["top5"] for o in outputs] == [e["top5"] for e in expected]


def test_no_weights_is_refused_and_a_wrong_file_says_what_it_is(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="FERRY_RESNET50_WEIGHTS"):
        shipped_runtime("resnet50", load=False, overrides={"weights": ""})
    wrong = tmp_path / "wrong.pth"
    torch.save({"fc.weight": torch.zeros(3, 3)}, wrong)
    with pytest.raises(ValueError, match="not a resnet50 state_dict"):
        shipped_runtime("resnet50", overrides={"weights": str(wrong)})


def test_an_undecodable_image_fails_alone(random_runtime: TorchvisionRuntime) -> None:
    broken = base64.b64encode(base64.b64decode(IMAGES[0])[:60]).decode()  # a cut-off PNG
    results = run_isolating(random_runtime.run, [IMAGES[0], broken, IMAGES[2]])
    assert [result.ok for result in results] == [True, False, True]
    assert results[1].error


def test_a_resnet50_job_runs_through_the_api_and_a_worker(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    settings: Settings,
) -> None:
    resnet = settings.model_copy(
        update={"model_parameters": {"resnet50": {"random_weights": True}}, "device": "cpu"}
    )
    job = submit(client, auth, model="resnet50", input=IMAGES[1], priority="vip")
    refused = client.post(
        "/v1/jobs", json={"model": "resnet50", "input": "R0lGODlh"}, headers=auth
    )  # a GIF's header
    assert refused.status_code == 422
    assert "input: must be a JPEG or PNG image" in refused.json()["error"]["message"]
    with RunningLoop(build_loop(resnet, "resnet50")):
        row = wait_terminal(sessions, [job], timeout=60)[job]
    assert row.status == "succeeded", row.error
    assert row.cost == 224 * 224
    output = row.output
    assert output is not None
    assert output["weights"] == "random" and len(output["top5"]) == 5


def test_odd_images_decode_to_the_square_without_blowing_up(
    random_runtime: TorchvisionRuntime,
) -> None:
    import numpy as np

    sliver = encoded((10, 200, 30), (10, 40_000))  # 1:4000: resized only in its centre square
    began = time.monotonic()
    pixels = random_runtime._decode(sliver)
    assert pixels.shape == (3, 224, 224) and time.monotonic() - began < 5
    # 16-bit greyscale: scaled to 8 bits, not clipped to white.
    ramp = np.tile(np.linspace(0, 65535, 256, dtype=np.uint16), (256, 1))
    buffer = io.BytesIO()
    Image.fromarray(ramp).save(buffer, format="PNG")
    grey = random_runtime._decode(base64.b64encode(buffer.getvalue()).decode())
    assert float(grey.max()) - float(grey.min()) > 3.0  # a ramp, not a constant


def test_the_three_stages_give_what_run_gives(random_runtime: TorchvisionRuntime) -> None:
    # On the CPU a launch computes at once: the loop does not launch ahead there.
    assert not random_runtime.asynchronous
    first = random_runtime.prepare(IMAGES)
    second = random_runtime.prepare(IMAGES[::-1])  # staged before the first is launched
    (images,) = first.tensors
    assert tuple(images.shape) == (3, 3, 224, 224)
    assert torch.equal(images[1], torch.from_numpy(random_runtime._decode(IMAGES[1])))
    ahead = random_runtime.collect(random_runtime.launch(first))
    reversed_ahead = random_runtime.collect(random_runtime.launch(second))
    whole = random_runtime.run(IMAGES)
    for one, other in [*zip(ahead, whole, strict=True), *zip(reversed_ahead[::-1], whole,
                                                              strict=True)]:  # fmt: skip
        assert [e["class"] for e in one["top5"]] == [e["class"] for e in other["top5"]]
        for a, b in zip(one["top5"], other["top5"], strict=True):
            assert a["score"] == pytest.approx(b["score"], abs=1e-4)
