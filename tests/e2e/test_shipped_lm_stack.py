"""`ferry up` serving the shipped tiny-llama from its recipe alone, as a user starts it:
the files built on start, a chat job answered, its tokens streamed, the same greedy
answer twice."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import webclient
from harness.stack import FerryUp

pytestmark = pytest.mark.e2e

SHIPPED = Path(__file__).resolve().parents[2] / "models"
MESSAGES = [{"role": "user", "content": "When does a ferry leave?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FerryUp]:
    root = tmp_path_factory.mktemp("lm-stack")
    # Only what git keeps: model.toml and the recipe, nothing built.
    version = root / "models" / "tiny-llama" / "1"
    version.mkdir(parents=True)
    shutil.copy(SHIPPED / "tiny-llama" / "model.toml", version.parent / "model.toml")
    shutil.copy(SHIPPED / "tiny-llama" / "1" / "lm-build.toml", version / "lm-build.toml")
    stack = FerryUp(
        root,
        FERRY_MODELS="tiny-llama",
        FERRY_MODEL_REPOSITORY=str(root / "models"),
        FERRY_FLOWER_PORT="0",  # no Flower: nothing here looks at it
    )
    with stack.running(timeout_s=240):
        yield stack


def _auth(stack: FerryUp) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.token}"}


def _run(stack: FerryUp, generation: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "tiny-llama", "input": generation}
    submitted = webclient.post(f"{stack.base}/v1/jobs", json=body, headers=_auth(stack), timeout=30)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    until = time.monotonic() + 120
    while time.monotonic() < until:
        job = webclient.get(
            f"{stack.base}/v1/jobs/{job_id}", params={"wait": 10}, headers=_auth(stack), timeout=30
        ).json()
        if job["status"] not in ("queued", "running"):
            return dict(job)
    raise AssertionError(f"job {job_id} did not finish: {job}")


def test_the_files_are_built_on_start_and_said_to_be_noise(stack: FerryUp) -> None:
    text = "".join(stack.output)
    assert "built tiny-llama version 1 in " in text
    assert "random weights, so the text it generates is noise" in text
    assert (stack.root / "models" / "tiny-llama" / "1" / "model.safetensors").is_file()


def test_a_chat_job_is_answered_and_the_same_greedy_job_answers_the_same(stack: FerryUp) -> None:
    generation = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    first = _run(stack, generation)
    assert first["status"] == "succeeded", first
    output = first["output"]
    completion = len(output["token_ids"])
    assert 1 <= completion <= 8
    assert output["finish_reason"] == ("length" if completion == 8 else "stop")
    usage = output["usage"]
    assert usage["completion_tokens"] == completion
    assert usage["total_tokens"] == usage["prompt_tokens"] + completion
    assert output["timings"]["ttft_ms"] is not None
    again = _run(stack, generation)
    assert again["output"]["token_ids"] == output["token_ids"]
    assert again["output"]["text"] == output["text"]


def test_a_jobs_tokens_are_streamed_and_add_up_to_its_text(stack: FerryUp) -> None:
    job = _run(stack, {"prompt": "A ferry leaves when", "max_tokens": 6, "seed": 7})
    assert job["output"]["seed"] == 7
    events: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream(
        "GET", f"{stack.base}/v1/jobs/{job['id']}/events", headers=_auth(stack), timeout=30
    ) as response:
        assert response.status_code == 200
        kind = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
    tokens = [data for kind, data in events if kind == "token"]
    assert [t["index"] for t in tokens] == list(range(len(job["output"]["token_ids"])))
    assert [t["token"] for t in tokens] == job["output"]["token_ids"]
    assert "".join(t["text"] for t in tokens) == job["output"]["text"]
    assert events[-1] == (
        "done",
        {"status": "succeeded", "finish_reason": job["output"]["finish_reason"]},
    )
