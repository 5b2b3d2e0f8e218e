"""A generation model's worker on real parts: the API, Redis, the database, a real model folder.

Jobs go in through ``POST /v1/jobs``; the worker loop (in a thread of the
test, as the other integration tests run theirs) reads the model's streams,
steps the engine, streams each token to the job's events stream and
records the result. What comes out is checked against the library's own
``generate()`` on the same folder.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker
from transformers import AutoConfig, AutoModelForCausalLM

from api.app import create_app
from backends.generation.load import eos_ids
from backends.generation.runtime import StepRuntime
from core.config.settings import Settings
from core.db.keys import create_key, set_weight
from core.models.generation import prompt_token_ids
from core.streams.events import JobEvent
from core.streams.protocol import cancels_key, events_key
from tests.integration.generation_worker import (
    MODEL,
    Worker,
    events,
    generation_settings,
    result,
    slow_steps,
    submit,
)
from tests.lm import lm_folder


@cache
def library_model() -> Any:
    return AutoModelForCausalLM.from_pretrained(lm_folder("llama")).eval()


@cache
def eos() -> list[int]:
    folder = lm_folder("llama")
    return list(eos_ids(folder, AutoConfig.from_pretrained(folder)))


def reference(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The library's greedy generate() on the prompt alone."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = library_model().generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos(),
            pad_token_id=eos()[0],
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


@pytest.fixture
def gen_settings(settings: Settings, tmp_path: Path) -> Settings:
    return generation_settings(settings, tmp_path)


@dataclass
class Gen:
    """The handles most tests here use: the generation settings, a worker of them, Redis."""

    settings: Settings
    root: Path
    worker: Callable[..., Worker]
    redis: redis.Redis

    def variant(self, name: str, **repository_args: Any) -> Settings:
        """The settings serving a repository of their own, made under the test's folder."""
        return generation_settings(self.settings, self.root / name, **repository_args)


@pytest.fixture
def gen(gen_settings: Settings, tmp_path: Path, gen_worker: Callable[..., Worker]) -> Iterator[Gen]:
    client = redis.Redis.from_url(str(gen_settings.redis_url), decode_responses=True)
    yield Gen(gen_settings, tmp_path, gen_worker, client)
    client.close()


PROMPTS = [
    "Ferry queues jobs",
    "The scheduler decides each step; the runtime executes it",
    "a",
    "Workers drain Redis Streams in micro-batches whose size is chosen by cost, time and "
    "memory, and webhooks deliver the results to clients who asked for them.",
]


@pytest.mark.parametrize("pipeline", [True, False], ids=["recording-thread", "in-loop"])
def test_jobs_run_to_the_librarys_tokens_and_stream_every_token_in_order(
    gen_client: TestClient,
    auth: dict[str, str],
    gen: Gen,
    pipeline: bool,
) -> None:
    ids = [submit(gen_client, auth, prompt=p, max_tokens=12, temperature=0) for p in PROMPTS]
    running = gen.worker(settings=gen.settings.model_copy(update={"pipeline": pipeline}))
    finish = running.loop.recorder.finish
    writers: set[str] = set()

    def watched_finish(*args: Any, **kwargs: Any) -> Any:
        writers.add(threading.current_thread().name)
        return finish(*args, **kwargs)

    running.loop.recorder.finish = watched_finish  # type: ignore[method-assign]
    with running:
        jobs = [result(gen_client, auth, job_id) for job_id in ids]
    # Pipelined, outcomes are written on the recording thread, else on the loop's.
    assert writers and all(name.startswith("record-") == pipeline for name in writers), writers
    for job, job_id, text in zip(jobs, ids, PROMPTS, strict=True):
        assert job["status"] == "succeeded", job
        output = job["output"]
        prompt = prompt_token_ids({"prompt": text}, lm_folder("llama") / "tokenizer.json")
        expected = reference(prompt, 12)
        assert output["token_ids"] == expected
        assert output["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(expected),
            "total_tokens": len(prompt) + len(expected),
        }
        assert output["finish_reason"] in ("stop", "length")
        assert output["timings"]["ttft_ms"] > 0
        seen = events(gen.redis, gen.settings, job_id)
        assert seen[0] == JobEvent.running()
        tokens = [e for e in seen if e.kind == "token"]
        assert [e.index for e in tokens] == list(range(len(expected)))
        assert [e.token for e in tokens] == expected
        assert "".join(e.text or "" for e in tokens) == output["text"]
        assert seen[-1] == JobEvent.done("succeeded", output["finish_reason"])


def test_a_step_that_raises_fails_only_the_job_at_fault_and_the_others_resume(
    gen_client: TestClient,
    auth: dict[str, str],
    gen: Gen,
) -> None:
    tokenizer = lm_folder("llama") / "tokenizer.json"
    expected = [reference(prompt_token_ids({"prompt": p}, tokenizer), 12) for p in PROMPTS]
    ids = [submit(gen_client, auth, prompt=p, max_tokens=12, temperature=0) for p in PROMPTS]
    # The job at fault: the one that decodes longest, so that the others have
    # tokens of their own when the steps it is in raise.
    poison = ids[max(range(len(ids)), key=lambda i: len(expected[i]))]
    running = gen.worker()
    runtime = running.loop.engine.runtime
    assert isinstance(runtime, StepRuntime)  # the llama folder is stepped natively
    execute = runtime.execute
    failed_steps: list[int] = []

    def poisoned(plan: Any) -> Any:
        computing = {c.id for c in plan.prefill} | set(plan.decode)
        if poison in computing and runtime.tokens(poison):  # from its first decode on
            failed_steps.append(len(computing))
            raise RuntimeError("a poisoned input")
        return execute(plan)

    runtime.execute = poisoned  # type: ignore[method-assign]
    with running:
        jobs = {job_id: result(gen_client, auth, job_id) for job_id in ids}
    assert jobs[poison]["status"] == "failed"
    assert "RuntimeError: a poisoned input" in jobs[poison]["error"]
    # It raised beside the others first, then alone: only then did it fail.
    assert failed_steps[0] > 1 and failed_steps[-1] == 1, failed_steps
    for job_id, tokens in zip(ids, expected, strict=True):
        seen = events(gen.redis, gen.settings, job_id)
        assert [e for e in seen if e == JobEvent.running()] == [JobEvent.running()]  # claimed once
        if job_id == poison:
            assert seen[-1] == JobEvent.done("failed", None)
            continue
        job = jobs[job_id]
        assert job["status"] == "succeeded", job
        # Resumed from the tokens it had: the library's tokens, each streamed once.
        assert job["output"]["token_ids"] == tokens
        streamed = [e for e in seen if e.kind == "token"]
        assert [e.index for e in streamed] == list(range(len(tokens)))
        assert [e.token for e in streamed] == tokens


def test_cancelling_a_running_job_keeps_its_tokens_and_lets_a_waiting_one_start(
    gen: Gen, auth: dict[str, str]
) -> None:
    one_slot = gen.variant("one", max_running=1)
    with TestClient(create_app(one_slot)) as client:
        long = submit(client, auth, prompt="a long one", max_tokens=400, temperature=0)
        waiting = submit(client, auth, prompt="next", max_tokens=4, temperature=0)
        with gen.worker(settings=one_slot):
            key = events_key(one_slot.key_prefix, MODEL, long)
            ends = time.monotonic() + 60
            while gen.redis.xlen(key) < 6 and time.monotonic() < ends:
                time.sleep(0.01)
            assert client.get(f"/v1/jobs/{waiting}", headers=auth).json()["status"] == "queued"
            gen.redis.sadd(cancels_key(one_slot.key_prefix, MODEL), long)
            cancelled = result(client, auth, long)
            started = result(client, auth, waiting)
    assert cancelled["status"] == "cancelled"
    produced = cancelled["output"]["token_ids"]
    assert 5 <= len(produced) < 400
    assert cancelled["output"]["finish_reason"] == "cancelled"
    assert started["status"] == "succeeded"
    seen = events(gen.redis, one_slot, long)
    assert [e.token for e in seen if e.kind == "token"] == produced
    assert seen[-1] == JobEvent.done("cancelled", "cancelled")


def test_an_urgent_job_gets_its_first_token_within_a_few_steps_of_a_full_bulk_batch(
    gen: Gen, auth: dict[str, str]
) -> None:
    full = gen.variant("full", max_running=4, kv_blocks=40)
    with TestClient(create_app(full)) as client:
        bulk = [
            submit(client, auth, prompt=f"bulk work {i}", max_tokens=120, priority="bulk")
            for i in range(8)
        ]
        with gen.worker(settings=full) as loop:
            ends = time.monotonic() + 60
            while loop.engine.scheduler.running_count < 4 and time.monotonic() < ends:
                time.sleep(0.005)
            assert loop.engine.scheduler.running_count == 4
            steps_before = loop.steps
            urgent = submit(client, auth, prompt="urgent", max_tokens=4, priority="urgent")
            key = events_key(full.key_prefix, MODEL, urgent)
            while not any(
                JobEvent.decode(f).kind == "token"  # type: ignore[arg-type]
                for _, f in gen.redis.xrange(key)  # type: ignore[union-attr]
            ):
                assert time.monotonic() < ends, "the urgent job never produced a token"
                time.sleep(0.002)
            steps_to_first_token = loop.steps - steps_before
            done = result(client, auth, urgent)
            # The bulk batch went on (none of it failed) after the urgent job preempted it.
            for job_id in bulk:
                client.delete(f"/v1/jobs/{job_id}", headers=auth)
    assert done["status"] == "succeeded"
    # Read, admitted (preempting bulk), prefilled and sampled: a handful of steps,
    # not the hundreds a bulk sequence still had to run.
    assert steps_to_first_token <= 10, steps_to_first_token


def test_the_kv_budget_holds_under_a_load_that_naive_admission_would_overflow(
    gen: Gen, auth: dict[str, str]
) -> None:
    tight = gen.variant("tight", max_running=16, kv_blocks=24)
    with TestClient(create_app(tight)) as client:
        ids = [submit(client, auth, prompt=f"job {i} " * 3, max_tokens=40) for i in range(24)]
        running = gen.worker(settings=tight)
        with running:
            jobs = [result(client, auth, job_id, wait_s=120) for job_id in ids]
    # Each job reserves ceil((prompt + 40) / 16) = 4 blocks: 24 jobs would need 96.
    assert all(job["status"] == "succeeded" for job in jobs)
    assert 0 < running.peak_blocks <= 24


def test_a_job_that_cannot_start_before_its_deadline_expires_without_reaching_the_device(
    gen: Gen, auth: dict[str, str]
) -> None:
    # No EOS: the urgent job holds the only slot until it is cancelled.
    one_slot = gen.variant("deadline", max_running=1, eos=False)
    with TestClient(create_app(one_slot)) as client:
        # Submitted first, while nothing is queued ahead of it, so it is accepted.
        late_id = submit(client, auth, prompt="too late", max_tokens=4, deadline_ms=1500)
        long = submit(client, auth, prompt="first", max_tokens=1500, priority="urgent")
        with gen.worker(settings=one_slot):
            expired = result(client, auth, late_id)
            client.delete(f"/v1/jobs/{long}", headers=auth)
            gen.redis.sadd(cancels_key(one_slot.key_prefix, MODEL), long)
            ended = result(client, auth, long)
    assert (expired["status"], ended["output"]["finish_reason"]) == ("expired", "cancelled")
    seen = events(gen.redis, one_slot, late_id)
    assert seen == [JobEvent.done("expired")]  # never running, no token


def test_a_job_whose_deadline_passes_while_it_generates_ends_expired_with_its_tokens(
    gen: Gen, auth: dict[str, str]
) -> None:
    # No EOS: the job would run to its 1,500 tokens; its deadline bounds the whole job.
    no_eos = gen.variant("late", eos=False)
    # Loaded before the job is sent (not running yet: nothing published), so that however
    # slowly the machine loads a model, the job's 3 s start when its worker is ready.
    running = gen.worker(settings=no_eos)
    slow_steps(running, 0.01)  # a step at least 10 ms: 1,500 tokens cannot fit 3 s
    with TestClient(create_app(no_eos)) as client:
        # Accepted while no worker has published a step time (nothing to refuse it on).
        job_id = submit(client, auth, prompt="out of time", max_tokens=1500, deadline_ms=3000)
        following = submit(client, auth, prompt="next", max_tokens=4, temperature=0)
        with running as loop:
            job = result(client, auth, job_id)
            after = result(client, auth, following)
            assert loop.engine.scheduler.blocks_used == 0  # its KV freed when it expired
    assert job["status"] == "expired", job
    assert job["error"].startswith("its deadline passed while it generated"), job
    output = job["output"]
    assert output["finish_reason"] == "expired"
    produced = output["token_ids"]
    assert 1 <= len(produced) < 1500
    assert output["usage"]["completion_tokens"] == len(produced)
    seen = events(gen.redis, no_eos, job_id)
    assert [e.token for e in seen if e.kind == "token"] == produced
    assert seen[-1] == JobEvent.done("expired", "expired")
    assert after["status"] == "succeeded"


def test_a_generation_longer_than_the_events_ttl_keeps_its_whole_stream(
    gen: Gen, auth: dict[str, str]
) -> None:
    """The events stream is the generation's checkpoint: it must outlive FERRY_EVENTS_TTL_S
    while the job runs (its expiry set once at the first token let it vanish mid-run)."""
    ttl_s = 2
    short = gen.variant("ttl", eos=False).model_copy(update={"events_ttl_s": float(ttl_s)})
    with TestClient(create_app(short)) as client:
        job_id = submit(client, auth, prompt="a long run", max_tokens=150, temperature=0)
        running = gen.worker(settings=short)
        slow_steps(running, 0.04)  # 150 steps of at least 40 ms: three times the TTL
        with running:
            job = result(client, auth, job_id)
    assert job["status"] == "succeeded", job
    produced = job["output"]["token_ids"]
    assert len(produced) == 150
    seen = events(gen.redis, short, job_id)
    assert seen[0] == JobEvent.running()
    tokens = [e for e in seen if e.kind == "token"]
    assert [e.index for e in tokens] == list(range(150))
    assert [e.token for e in tokens] == produced
    assert seen[-1] == JobEvent.done("succeeded", "length")
    key = events_key(short.key_prefix, MODEL, job_id)
    assert 0 < gen.redis.ttl(key) <= ttl_s


def test_a_running_generation_reports_its_tokens_so_far_and_an_eta(
    gen: Gen, auth: dict[str, str]
) -> None:
    no_eos = gen.variant("progress", eos=False)
    with TestClient(create_app(no_eos)) as client:
        job_id = submit(client, auth, prompt="how far along", max_tokens=200, temperature=0)
        queued = client.get(f"/v1/jobs/{job_id}", headers=auth).json()
        assert queued["status"] == "queued" and queued["progress"] is None
        running = gen.worker(settings=no_eos)
        slow_steps(running, 0.02)  # 200 steps of at least 20 ms: it is seen running
        key = events_key(no_eos.key_prefix, MODEL, job_id)
        seen: list[dict[str, Any]] = []
        with running:
            ends = time.monotonic() + 120
            while time.monotonic() < ends:
                job = client.get(f"/v1/jobs/{job_id}", headers=auth).json()
                if job["status"] == "queued":
                    time.sleep(0.02)
                    continue
                if job["status"] != "running":
                    break
                streamed = sum(1 for e in events(gen.redis, no_eos, job_id) if e.kind == "token")
                progress = job["progress"]
                assert progress is not None and progress["max_tokens"] == 200, job
                # Read before the stream was: at most what it holds now.
                assert 0 <= progress["tokens"] <= streamed
                seen.append(progress)
                if progress["tokens"] >= 20 and progress["eta_ms"] is not None:
                    break
                time.sleep(0.05)
            assert seen and seen[-1]["tokens"] >= 20 and seen[-1]["eta_ms"] is not None, seen
            assert seen[-1]["eta_ms"] > 0
            counts = [p["tokens"] for p in seen]
            assert counts == sorted(counts)  # it only grows
            done = result(client, auth, job_id)
    assert done["status"] == "succeeded" and done["progress"] is None
    assert len(done["output"]["token_ids"]) == 200
    assert gen.redis.exists(key)


def test_two_keys_share_the_running_slots_by_weight_and_a_preempted_job_loses_no_work(
    gen: Gen, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        heavy_key, light_key = create_key(session, "heavy"), create_key(session, "light")
        set_weight(session, heavy_key.id, 3)
    heavy = {"Authorization": f"Bearer {heavy_key.token}"}
    light = {"Authorization": f"Bearer {light_key.token}"}
    four = gen.variant("shares", max_running=4, eos=False)
    with TestClient(create_app(four)) as client:
        # Six of the heavy key's, all greedy on one prompt: whichever is preempted and
        # resumed must still produce the same tokens as the others.
        heavies = [
            submit(client, heavy, prompt="the same words", max_tokens=80, temperature=0)
            for _ in range(6)
        ]
        running = gen.worker(settings=four)
        scheduler = running.loop.engine.scheduler
        runtime: Any = running.loop.engine.runtime
        execute = runtime.execute
        counts: list[tuple[int, int, int]] = []  # per step: heavy running, light running, waiting
        preempted: list[str] = []
        lights: list[str] = []

        def slowed(plan: Any) -> Any:
            preempted.extend(plan.preempted)
            time.sleep(0.02)  # 80 steps of at least 20 ms: the light key's jobs come mid-run
            result = execute(plan)
            ids = set(scheduler.owned_blocks())
            waiting = sum(1 for j in lights if scheduler.state_of(j) == "waiting")
            counts.append((len(ids & set(heavies)), len(ids & set(lights)), waiting))
            return result

        runtime.execute = slowed
        with running:
            ends = time.monotonic() + 60
            while not counts or counts[-1][0] < 4:
                assert time.monotonic() < ends, "the heavy key's jobs never filled the slots"
                time.sleep(0.01)
            lights += [
                submit(client, light, prompt=f"short {i}", max_tokens=8, temperature=0)
                for i in range(2)
            ]
            done = {job_id: result(client, heavy, job_id, wait_s=120) for job_id in heavies}
            done |= {job_id: result(client, light, job_id, wait_s=120) for job_id in lights}
    assert all(job["status"] == "succeeded" for job in done.values()), done
    outputs = {tuple(done[job_id]["output"]["token_ids"]) for job_id in heavies}
    assert len(outputs) == 1 and len(next(iter(outputs))) == 80
    # The light key took its share back from the heavy one's running jobs...
    assert set(preempted) & set(heavies), preempted
    # ... and held it by weight, 3 to 1 of the four slots: while a light job waited the heavy
    # key ran its three and no more; the light key never ran two at once (by equal weights
    # it would have had two slots).
    contended = [heavy_running for heavy_running, _, waiting in counts if waiting]
    assert contended and max(contended) == 3, counts
    assert max(light_running for _, light_running, _ in counts) == 1, counts


def test_redis_failing_between_a_steps_plan_and_its_output_loses_and_fails_nothing(
    gen_client: TestClient,
    auth: dict[str, str],
    gen_worker: Callable[..., Worker],
) -> None:
    ids = [submit(gen_client, auth, prompt=p, max_tokens=8, temperature=0) for p in PROMPTS]
    running = gen_worker()
    loop = running.loop
    claim = loop.recorder.claim
    failures: list[int] = []

    def claim_once_unreachable(*args: Any, **kwargs: Any) -> Any:
        if not failures:  # the first claim: the plan is made, its jobs not yet claimed
            failures.append(1)
            raise redis.ConnectionError("Redis went away")
        return claim(*args, **kwargs)

    loop.recorder.claim = claim_once_unreachable  # type: ignore[method-assign]
    with running:
        jobs = [result(gen_client, auth, job_id) for job_id in ids]
    assert failures
    tokenizer = lm_folder("llama") / "tokenizer.json"
    for job, text in zip(jobs, PROMPTS, strict=True):
        # Read again after the outage, run once, from the start: the library's tokens.
        assert job["status"] == "succeeded", job
        assert job["attempts"] == 1, job
        assert job["output"]["token_ids"] == reference(prompt_token_ids({"prompt": text},
                                                                        tokenizer), 8)  # fmt: skip
