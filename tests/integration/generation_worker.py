"""A generation model's worker for the integration tests: its repository, settings and thread.

The model is the llama-shaped folder ``tests.lm`` builds (random weights, a
trained tokenizer, a chat template), served through the real ``causal-lm``
backend by a real ``GenerationLoop`` on a thread of the test, as the other
integration tests run their workers.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import redis
from fastapi.testclient import TestClient

from backends.catalog import repository_for
from core.config.settings import Settings
from core.streams.events import JobEvent
from core.streams.protocol import events_key
from tests.integration.conftest import RunningLoop
from tests.lm import lm_folder
from tests.models import REPOSITORY
from workers.gpu.generation_loop import GenerationLoop
from workers.gpu.generation_main import build_generation_loop

MODEL = "tiny"
TOML = """
name = "tiny"
backend = "causal-lm"
description = "A llama-shaped model with random weights: its text is noise."

[input]
kind = "generation"
tokenizer = "tokenizer.json"
default_max_tokens = 16

[cost]
function = "tokens"

[parameters]
max_running = {max_running}
step_tokens = 256
prefill_chunk_tokens = 64
kv_cache_bytes = {kv_bytes}
"""


def repository(
    root: Path,
    max_running: int = 8,
    kv_blocks: int = 512,
    beside: tuple[str, ...] = (),
    eos: bool = True,
) -> Path:
    """A repository holding the generation model (and ``beside``: shipped models copied in).

    ``eos=False``: its generation_config.json names no end-of-sequence token, so a job runs
    to its max_tokens (random weights hit EOS at random: a job meant to hold the device
    for its max_tokens may otherwise end after a few dozen)."""
    folder = root / "repository" / MODEL
    shutil.copytree(lm_folder("llama"), folder / "1")
    if not eos:
        config_path = folder / "1" / "generation_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config_path.write_text(json.dumps({**config, "eos_token_id": []}), encoding="utf-8")
    # llama-shaped test model: 4 layers x 2 KV heads x 32 dims x 2 (K, V) x 4 bytes a token.
    kv_bytes = kv_blocks * 16 * 4 * 2 * 32 * 2 * 4
    (folder / "model.toml").write_text(TOML.format(max_running=max_running, kv_bytes=kv_bytes))
    for name in beside:
        shutil.copytree(REPOSITORY / name, root / "repository" / name)
    return folder.parent


def generation_settings(settings: Settings, root: Path, **repository_args: Any) -> Settings:
    """``settings`` serving the generation model of a repository made under ``root``."""
    beside = repository_args.get("beside", ())
    return settings.model_copy(
        update={
            "model_repository": repository(root, **repository_args),
            "models": ",".join((MODEL, *beside)),
            "model_parameters": {},
            "cpu_threads": 1,
        }
    )


class Worker(RunningLoop[GenerationLoop]):
    """A generation loop on a thread of the test, keeping the most KV blocks its scheduler
    held at once (``peak_blocks``)."""

    join_s = 30.0

    def __init__(self, loop: GenerationLoop) -> None:
        super().__init__(loop)
        self.peak_blocks = 0

    def __enter__(self) -> GenerationLoop:
        scheduler = self.loop.engine.scheduler
        step = self.loop.step

        def watched() -> None:
            step()
            self.peak_blocks = max(self.peak_blocks, scheduler.blocks_used)

        self.loop.step = watched  # type: ignore[method-assign]
        return super().__enter__()


def start_worker(settings: Settings, name: str = "gen-worker") -> Worker:
    """A worker of the generation model (entered, it runs on a thread)."""
    config = repository_for(settings).models[MODEL]
    return Worker(build_generation_loop(settings, config, "cpu", name))


def slow_steps(running: Worker, step_s: float) -> Worker:
    """Each of ``running``'s steps lasts at least ``step_s`` (a larger model's would): a test
    can reach its jobs mid-generation however fast the machine."""
    runtime: Any = running.loop.engine.runtime
    execute = runtime.execute

    def slowed(plan: Any) -> Any:
        time.sleep(step_s)
        return execute(plan)

    runtime.execute = slowed
    return running


def submit(client: TestClient, auth: dict[str, str], **input: Any) -> str:
    body: dict[str, Any] = {"model": MODEL, "input": input}
    for field in ("priority", "version", "deadline_ms"):  # the job's own, not its input's
        if field in input:
            body[field] = input.pop(field)
    response = client.post("/v1/jobs", json=body, headers=auth)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def result(client: TestClient, auth: dict[str, str], job_id: str, wait_s: float = 60) -> Any:
    ends = time.monotonic() + wait_s
    while time.monotonic() < ends:
        job = client.get(f"/v1/jobs/{job_id}?wait=5", headers=auth).json()
        if job["status"] not in ("queued", "running"):
            return job
    raise AssertionError(f"job {job_id} did not end within {wait_s} s")


def events(rclient: redis.Redis, settings: Settings, job_id: str) -> list[JobEvent]:
    entries = rclient.xrange(events_key(settings.key_prefix, MODEL, job_id))
    return [JobEvent.decode(fields) for _, fields in entries]  # type: ignore[union-attr,arg-type]


def greedy(folder: Path, prompt: str, max_tokens: int) -> list[int]:
    """The library's greedy generate() on ``folder`` (its own generation_config: a folder
    naming no end-of-sequence token runs to max_tokens), the prompt alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.models.generation import prompt_token_ids

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([prompt_token_ids({"prompt": prompt}, folder / "tokenizer.json")])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, ids.shape[1] :]]
