"""Hot reload of a generation model: a generation ends on the version that started it.

A real generation worker serves version 1 of a llama-shaped folder; version 2
is the same architecture with other weights. Activated through the admin
endpoint while a long generation runs, version 2 is loaded beside 1; the
running job finishes on 1 (its tokens the library's on 1's folder), and the
jobs that start afterwards run on 2 (the library's tokens on 2's folder).
Each job records the version that ran it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from core.config.settings import Settings
from core.db.versions import version_states
from core.streams.events import JobEvent
from core.streams.protocol import events_key
from tests.integration.conftest import activate
from tests.integration.generation_worker import (
    MODEL,
    events,
    generation_settings,
    greedy,
    result,
    slow_steps,
    start_worker,
    submit,
)
from tests.lm import lm_folder

# The database is not this module's subject (the job path's own tests run on both).
pytestmark = pytest.mark.one_database("postgresql")

LONG_TOKENS = 300


def no_eos(folder: Path) -> None:
    """Its generation_config.json names no end-of-sequence token: a job runs to max_tokens."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, "eos_token_id": []}), encoding="utf-8")


def active_version_is(client: TestClient, auth: dict[str, str], version: int) -> bool:
    data = client.get("/v1/models", headers=auth).json()["data"]
    versions = next(m for m in data if m["name"] == MODEL)["versions"]
    return any(v["version"] == version and v["active"] for v in versions)


@pytest.fixture
def gen_settings(settings: Settings, tmp_path: Path) -> Settings:
    """The generation model with versions 1 and 2 (other weights), 1 active, polled often."""
    reload = generation_settings(settings, tmp_path, eos=False).model_copy(
        update={"model_poll_s": 0.2}
    )
    folder = tmp_path / "repository" / MODEL
    shutil.copytree(lm_folder("llama", seed=1), folder / "2")
    no_eos(folder / "2")
    toml = folder / "model.toml"
    toml.write_text("active_version = 1\n" + toml.read_text(encoding="utf-8"), encoding="utf-8")
    return reload


@pytest.fixture
def folder(gen_settings: Settings) -> Path:
    """The generation model's folder in the repository: a folder a version."""
    assert gen_settings.model_repository is not None
    return gen_settings.model_repository / MODEL


def test_a_running_generation_ends_on_its_version_and_the_next_jobs_run_on_the_new_one(
    gen_settings: Settings,
    gen_client: TestClient,
    auth: dict[str, str],
    admin: dict[str, str],
    folder: Path,
) -> None:
    settings = gen_settings
    rclient = redis.Redis.from_url(str(settings.redis_url), decode_responses=True)
    worker = start_worker(settings)
    # Version 1's steps take 20 ms more: the long job outlasts version 2's load.
    slow_steps(worker, 0.02)
    with worker as loop:
        long = submit(gen_client, auth, prompt="a long one", max_tokens=LONG_TOKENS, temperature=0)
        key = events_key(settings.key_prefix, MODEL, long)
        ends = time.monotonic() + 60
        while rclient.xlen(key) < 4 and time.monotonic() < ends:
            time.sleep(0.01)
        activate(gen_client, admin, MODEL, 2)
        # Loaded beside 1 while the long job runs: 1 is still the one serving it.
        ends = time.monotonic() + 60
        while loop.switching_to is None and loop.version == 1 and time.monotonic() < ends:
            time.sleep(0.01)
        states = version_states(rclient, settings.key_prefix, MODEL)
        assert rclient.xlen(key) < LONG_TOKENS + 1, "the long job ended before 2 was loaded"
        assert loop.switching_to == 2 and loop.version == 1, states
        assert states[1].state == "ready" and states[2].state == "loading", states
        after = [
            submit(gen_client, auth, prompt=p, max_tokens=8, temperature=0)
            for p in ("next", "and another")
        ]
        done = {job_id: result(gen_client, auth, job_id) for job_id in (long, *after)}
        assert loop.version == 2
    first = done[long]
    assert first["status"] == "succeeded" and first["model_version"] == 1, first
    assert first["output"]["token_ids"] == greedy(folder / "1", "a long one", LONG_TOKENS)
    streamed = [e for e in events(rclient, settings, long) if e.kind == "token"]
    assert [e.index for e in streamed] == list(range(LONG_TOKENS))
    for job_id, prompt in zip(after, ("next", "and another"), strict=True):
        job = done[job_id]
        assert job["status"] == "succeeded" and job["model_version"] == 2, job
        assert job["output"]["token_ids"] == greedy(folder / "2", prompt, 8)
        seen = events(rclient, settings, job_id)
        assert [e for e in seen if e == JobEvent.running()] == [JobEvent.running()]
    rclient.close()


def test_a_job_pinned_to_a_version_no_longer_served_fails_and_one_pinned_to_the_served_runs(
    gen_settings: Settings,
    gen_client: TestClient,
    auth: dict[str, str],
    admin: dict[str, str],
    folder: Path,
) -> None:
    old = submit(gen_client, auth, prompt="pinned", max_tokens=4, temperature=0, version=1)
    activate(gen_client, admin, MODEL, 2)
    ends = time.monotonic() + 30
    while not active_version_is(gen_client, auth, 2):  # the API sees it within its poll interval
        assert time.monotonic() < ends, "the API never saw version 2 active"
        time.sleep(0.05)
    new = submit(gen_client, auth, prompt="pinned", max_tokens=4, temperature=0, version=2)
    with start_worker(gen_settings) as loop:  # it starts on the active version, 2
        done = {job_id: result(gen_client, auth, job_id) for job_id in (old, new)}
        assert loop.version == 2
    assert done[new]["status"] == "succeeded" and done[new]["model_version"] == 2, done[new]
    assert done[new]["output"]["token_ids"] == greedy(folder / "2", "pinned", 4)
    assert done[old]["status"] == "failed", done[old]
    assert done[old]["error"] == (
        f"version 1 of {MODEL} is not served now (the active version is 2; serving 2)"
    )


def test_a_rollback_before_the_switch_keeps_the_version_serving_and_its_jobs(
    gen_settings: Settings,
    gen_client: TestClient,
    auth: dict[str, str],
    admin: dict[str, str],
    folder: Path,
) -> None:
    settings = gen_settings
    worker = start_worker(settings)
    slow_steps(worker, 0.02)  # version 1's long job outlasts the load of 2 and the rollback
    with worker as loop:
        long = submit(gen_client, auth, prompt="a long one", max_tokens=LONG_TOKENS, temperature=0)
        ends = time.monotonic() + 60
        while loop.engine.scheduler.running_count == 0 and time.monotonic() < ends:
            time.sleep(0.01)
        activate(gen_client, admin, MODEL, 2)
        while loop.switching_to != 2 and time.monotonic() < ends:
            time.sleep(0.01)
        assert loop.switching_to == 2, "version 2 never loaded"
        waiting = submit(gen_client, auth, prompt="next", max_tokens=8, temperature=0)
        activate(gen_client, admin, MODEL, 1)  # rolled back before 2 served
        while loop.switching_to is not None and time.monotonic() < ends:
            time.sleep(0.01)
        assert loop.switching_to is None and loop.version == 1
        done = {job_id: result(gen_client, auth, job_id) for job_id in (long, waiting)}
        assert loop.version == 1
    for job_id, prompt, tokens in ((long, "a long one", LONG_TOKENS), (waiting, "next", 8)):
        job = done[job_id]
        assert job["status"] == "succeeded" and job["model_version"] == 1, job
        assert job["output"]["token_ids"] == greedy(folder / "1", prompt, tokens)
