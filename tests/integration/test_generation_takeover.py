"""A generation survives its worker: another takes it over from its checkpoint.

Worker A dies mid-generation (its loop's thread ends at once, acknowledging
and recording nothing, as a killed process would leave things). Worker B
takes A's entries over once they have been idle for the visibility timeout,
reads each job's checkpoint (the tokens in its events stream) and goes on
from there. The outputs must equal uninterrupted runs token for token
(greedy: the library's ``generate()``; sampled, seeded or not: Ferry's own
uninterrupted run with the same seed), and each stream must hold every token
once, in order, across the takeover.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Job
from core.streams.events import JobEvent
from tests.integration.generation_worker import (
    MODEL,
    events,
    generation_settings,
    greedy,
    result,
    start_worker,
    submit,
)

MAX_TOKENS = 40
KILLED_AFTER = 10  # tokens of the first job to get there


class WorkerKilled(BaseException):
    """Ends a worker's loop where it stands (nothing handles a BaseException of its own)."""


@pytest.fixture
def gen_settings(settings: Settings, tmp_path: Path) -> Settings:
    # No end-of-sequence token: every job runs to MAX_TOKENS, past the kill.
    return generation_settings(settings, tmp_path, eos=False).model_copy(
        update={"visibility_timeout_s": 1.0}
    )


def test_a_worker_that_dies_mid_generation_loses_no_token(
    gen_settings: Settings,
    gen_client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="workers.gpu.generation_loop")
    settings = gen_settings
    assert settings.model_repository is not None
    folder = settings.model_repository / MODEL / "1"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == []
    jobs = {
        "greedy": submit(
            gen_client, auth, prompt="a long one", max_tokens=MAX_TOKENS, temperature=0
        ),
        "seeded": submit(
            gen_client, auth, prompt="seeded", max_tokens=MAX_TOKENS, temperature=0.9, seed=7
        ),
        "unseeded": submit(
            gen_client, auth, prompt="no seed", max_tokens=MAX_TOKENS, temperature=1
        ),
        # Its tokens' logprobs: those streamed before the death are kept, not recomputed.
        "logprobs": submit(
            gen_client, auth, prompt="a long one", max_tokens=MAX_TOKENS, temperature=0, logprobs=2
        ),
    }
    rclient = redis.Redis.from_url(str(settings.redis_url), decode_responses=True)

    dying = start_worker(settings, "worker-a")
    runtime: Any = dying.loop.engine.runtime
    execute = runtime.execute

    def dies_mid_generation(plan: Any) -> Any:
        if any(len(runtime.tokens(job_id)) >= KILLED_AFTER for job_id in jobs.values()):
            raise WorkerKilled
        return execute(plan)

    runtime.execute = dies_mid_generation
    died = threading.Event()

    def run() -> None:
        try:
            dying.loop.run(threading.Event())
        except WorkerKilled:
            died.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert died.is_set(), "worker A did not reach its death"
    streamed = {name: events(rclient, settings, job_id) for name, job_id in jobs.items()}
    before = {name: sum(e.kind == "token" for e in seen) for name, seen in streamed.items()}
    assert max(before.values()) >= KILLED_AFTER - 1, before
    with sessions() as session:
        rows = {name: session.get(Job, job_id) for name, job_id in jobs.items()}
        assert {r.status for r in rows.values() if r is not None} == {"running"}

    with start_worker(settings, "worker-b"):  # takes A's entries over after 1 s idle
        done = {name: result(gen_client, auth, job_id) for name, job_id in jobs.items()}
        # The sampled jobs again, uninterrupted, with the seed each one used.
        again = {
            name: submit(
                gen_client,
                auth,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=temperature,
                seed=done[name]["output"]["seed"],
            )
            for name, prompt, temperature in (("seeded", "seeded", 0.9), ("unseeded", "no seed", 1))
        }
        uninterrupted = {name: result(gen_client, auth, job_id) for name, job_id in again.items()}

    assert done["seeded"]["output"]["seed"] == 7
    # B went on from each job's streamed tokens (less the last, computed again).
    resumed = {
        r.job_id: r.tokens  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "generation taken over from its checkpoint"
    }
    assert resumed == {job_id: before[name] - 1 for name, job_id in jobs.items()}, resumed
    for name, job_id in jobs.items():
        job = done[name]
        assert job["status"] == "succeeded", job
        assert job["attempts"] == 2, job  # A's start, then B's: taken over, not run anew
        tokens = job["output"]["token_ids"]
        assert len(tokens) == MAX_TOKENS
        expected = (
            greedy(folder, "a long one", MAX_TOKENS)
            if name in ("greedy", "logprobs")
            else uninterrupted[name]["output"]["token_ids"]
        )
        assert tokens == expected, name
        seen = events(rclient, settings, job_id)
        streamed_tokens = [e for e in seen if e.kind == "token"]
        # Every token once, in order, across the takeover; the text is the output's.
        assert [e.index for e in streamed_tokens] == list(range(MAX_TOKENS)), name
        assert [e.token for e in streamed_tokens] == tokens, name
        assert "".join(e.text or "" for e in streamed_tokens) == job["output"]["text"], name
        # Two starts (a pause in the stream, not an error), one end.
        assert [e for e in seen if e == JobEvent.running()] == [JobEvent.running()] * 2
        assert seen[-1] == JobEvent.done("succeeded", "length")
        if name != "logprobs":
            assert "logprobs" not in job["output"]
            continue
        # One per token, each as its event streamed it: A's (read back by B) and B's;
        # the token B computed again (A's last) as A streamed it, to the float's noise.
        stored = job["output"]["logprobs"]
        assert [e["token"] for e in stored] == tokens
        at_death = before[name] - 1
        assert [e.logprob for e in streamed_tokens[:at_death]] == stored[:at_death]
        assert [e.logprob for e in streamed_tokens[at_death + 1 :]] == stored[at_death + 1 :]
        again_computed = streamed_tokens[at_death].logprob
        assert again_computed is not None
        assert again_computed["logprob"] == pytest.approx(stored[at_death]["logprob"], abs=1e-4)
    rclient.close()
