"""Generation jobs whose worker loses its host's network, or its device, mid-generation.

The same stack, witnesses and counts as ``test_generation_faults`` (read its
docstring): the test model served by ``python -m ferry worker`` processes, the
model's witness in each, every job's events stream, the transition log and the
library's greedy reference.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from sqlalchemy.engine import make_url

from core.streams.protocol import GROUP, workers_key
from harness.accounting import Figures
from harness.faults import Stack
from harness.lm_witness import CUDA_ERROR, DEVICE_LOSS_ENV
from harness.netns import Host, Network
from harness.processes import wait_for
from harness.proxy import TcpProxy
from harness.witness import read_transitions, terminal_writes
from tests.faults.test_generation_faults import (
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    account,
    events,
    generation_stack,
    greedy_in_background,
    start_worker,
    streamed,
    submit,
    wait_generating,
    witness_env,
)
from workers.gpu.main import DEVICE_LOST_EXIT_CODE

pytestmark = pytest.mark.faults

# What the generation worker logs when it stops for a lost device, and when Redis or the
# database fails it (it drops what it holds and reads its pending entries again).
DEVICE_LOST = "device lost; the worker exits to be started again"
OUTAGE = "dependency error; retrying"


def json_logs(text: str) -> list[dict[str, Any]]:
    records = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


@contextlib.contextmanager
def host_off_the_stack(stack: Stack, tmp_path: Path) -> Iterator[tuple[Host, dict[str, str]]]:
    """A test host in a network namespace that reaches the stack's Redis and database only
    through its link (proxies on the bridge's address), and the environment a Ferry process
    there needs. Gone, with its processes, at the end."""
    with contextlib.ExitStack() as cleanup:
        net = cleanup.enter_context(Network(tmp_path / "hosts"))
        host = net.host("gpu")
        redis_at = urlsplit(stack.redis_url)
        database = make_url(stack.database_url)
        proxies = [
            TcpProxy(redis_at.hostname or "127.0.0.1", redis_at.port or 6379, net.gateway),
            TcpProxy(database.host or "127.0.0.1", database.port or 5432, net.gateway),
        ]
        for proxy in proxies:
            cleanup.callback(proxy.close)
        env = {
            **stack.env,
            **witness_env(stack),
            "FERRY_REDIS_URL": f"redis://{net.gateway}:{proxies[0].port}/0",
            "FERRY_DATABASE_URL": database.set(
                host=net.gateway, port=proxies[1].port
            ).render_as_string(hide_password=False),
        }
        yield host, env


def heartbeat(stack: Stack, name: str) -> float:
    """When the worker last said it was alive (0: never, or it left)."""
    with contextlib.suppress(redis.RedisError):
        return float(stack.redis.zscore(workers_key(stack.prefix, MODEL), name) or 0.0)
    return 0.0


def pending_of(stack: Stack, consumer: str) -> int:
    """The entries of the model's streams this consumer read and has not acknowledged."""
    count = 0
    for key in stack.redis.scan_iter(f"{stack.prefix}:{MODEL}:*"):
        with contextlib.suppress(redis.ResponseError):
            count += len(
                stack.redis.xpending_range(key, GROUP, "-", "+", 1000, consumername=consumer)
            )
    return count


@pytest.mark.multihost  # a host in a network namespace: root only
def test_a_generation_workers_host_cut_off_mid_generation_is_taken_over_and_writes_nothing(
    make_stack: Callable[..., Stack], tmp_path: Path, record: Callable[[Figures], None]
) -> None:
    """The worker's host loses its link while it generates a full batch: another worker takes
    the jobs over after the visibility timeout and goes on from their streamed tokens; the
    link back, the cut-off worker finds its entries taken and writes nothing more."""
    stack = generation_stack(make_stack, tmp_path)
    reference = greedy_in_background(stack, PROMPTS)
    with host_off_the_stack(stack, tmp_path) as (host, env):
        cut = host.spawn(
            [sys.executable, "-m", "ferry", "worker", "--model", MODEL, "--name", "w-cut"],
            env,
            log="worker",
        )
        wait_for("the cut-off worker's heartbeat", lambda: heartbeat(stack, "w-cut") > 0, 90)
        started = time.monotonic()
        submission = submit(stack, PROMPTS)
        ids = submission.accepted
        wait_generating(stack, ids, tokens=8)
        host.cut()  # it generates on, but reaches neither Redis nor the database
        at_cut = streamed(stack, ids)
        taker = start_worker(stack, "w2")
        figures, details, counts = account(
            stack, "a generation worker's host cut off mid-generation", submission, PROMPTS,
            reference, started, record, streamed_at_cut=sum(at_cut.values()),
        )  # fmt: skip
        frozen = {job_id: events(stack, job_id) for job_id in ids}
        restored_at = time.time()
        host.restore()
        # Back on the network, the cut-off worker beats again; whatever it still held
        # was taken over (its entries now another's, acknowledged and deleted).
        wait_for(
            "the cut-off worker to beat again", lambda: heartbeat(stack, "w-cut") > restored_at, 120
        )
        wait_for("the cut-off worker to hold nothing", lambda: pending_of(stack, "w-cut") == 0, 60)
        log = host.log("worker", 10**7)
        records = json_logs(log)
        # Either its Redis reply timed out in the cut (it dropped what it held, to read its
        # pending entries again, and found none left: taken over, acknowledged and deleted),
        # or the link came back first and its call, sent into the cut, was answered late.
        # It lives on either way.
        details["cut_worker_outages"] = sum(1 for r in records if r.get("msg") == OUTAGE)
        assert cut.poll() is None, log[-3000:]
        # Nothing it did once back changed a job: no second terminal write, and no event
        # (the token writes it sent into the cut, which TCP delivers once the link is back,
        # are refused: their index is not the stream's next).
        writes_after = terminal_writes(read_transitions(stack.engine, ids))
        details["written_after_restore"] = sum(1 for j in ids if writes_after.get(j, 0) > 1)
        changed = {
            job_id: now[len(frozen[job_id]) :]
            for job_id in ids
            if (now := events(stack, job_id)) != frozen[job_id]
        }
        assert not changed and details["written_after_restore"] == 0, (changed, details)
    assert figures.lost == 0 and figures.written_twice == 0, details
    assert set(details["statuses"].values()) == {"succeeded"}, details
    # The cut-off worker's claim, then the taker's: taken over once.
    assert set(details["attempts"].values()) == {2}, details
    assert not details["differs_from_reference"], details
    assert not details["stream_differs_from_output"], details
    assert taker.popen is not None
    for job_id, count in counts.items():
        assert count.indices == list(range(MAX_TOKENS)), (job_id, details)
        assert count.running_events == 2, (job_id, details)
        assert [run.pid for run in count.runs] == [cut.pid, taker.popen.pid], (job_id, details)
        (held,) = count.checkpoint
        assert held >= at_cut[job_id] >= 8, (job_id, details)
        assert count.first_generated()[1] == held - 1, (job_id, details)
    assert figures.run_twice == 0, details
    # Each job: the recomputed last token, and at most one step's the cut-off worker made
    # and could not stream.
    assert details["tokens_lost"] <= len(PROMPTS), details
    assert details["streamed_twice"] == 0 and details["stream_gaps"] == 0, details


def test_a_device_lost_mid_generation_restarts_the_worker_and_its_jobs_go_on(
    make_stack: Callable[..., Stack], tmp_path: Path, record: Callable[[Figures], None]
) -> None:
    """The device breaks mid-generation (every call raises CUDA's illegal memory access, and so
    does the device probe): the worker fails no job, it exits 75 and its supervisor starts it
    again; the restarted worker takes its own entries back at once and goes on from the
    jobs' streamed tokens."""
    stack = generation_stack(make_stack, tmp_path)
    reference = greedy_in_background(stack, PROMPTS)
    loss = stack.tmp / "lose-the-device"
    worker = start_worker(stack, "w1", supervised=True, env={DEVICE_LOSS_ENV: str(loss)})
    assert worker.popen is not None
    first_pid = worker.popen.pid
    started = time.monotonic()
    submission = submit(stack, PROMPTS)
    ids = submission.accepted
    wait_generating(stack, ids, tokens=8)
    loss.touch()  # the worker's next step finds its device gone
    wait_for("the worker to exit", lambda: bool(worker.exits), 60, 0.01)
    at_loss = streamed(stack, ids)
    figures, details, counts = account(
        stack, "device lost mid-generation (CUDA illegal memory access)", submission, PROMPTS,
        reference, started, record, streamed_at_loss=sum(at_loss.values()),
    )  # fmt: skip
    assert not loss.exists()  # the fault was taken, by one process
    assert worker.exits == [DEVICE_LOST_EXIT_CODE] and worker.starts == 2, details
    assert worker.alive()
    lost = [r for r in stack.log_lines(worker) if r.get("msg") == DEVICE_LOST]
    assert len(lost) == 1 and CUDA_ERROR in lost[0]["error"], lost
    assert worker.popen is not None
    assert figures.lost == 0 and figures.written_twice == 0, details
    assert set(details["statuses"].values()) == {"succeeded"}, details  # none failed for it
    assert set(details["attempts"].values()) == {2}, details
    assert not details["differs_from_reference"], details
    assert not details["stream_differs_from_output"], details
    for job_id, count in counts.items():
        assert count.indices == list(range(MAX_TOKENS)), (job_id, details)
        assert count.running_events == 2, (job_id, details)
        # The run the device loss ended, then the restarted worker's, from the checkpoint.
        assert [run.pid for run in count.runs] == [first_pid, worker.popen.pid], (job_id, details)
        (held,) = count.checkpoint
        assert held == at_loss[job_id] >= 8, (job_id, details)
        assert count.first_generated()[1] == held - 1, (job_id, details)
    assert figures.run_twice == 0, details
    # The step that raised computed nothing; every token before it was streamed: each job
    # recomputes its last streamed token, and loses none.
    assert details["tokens_lost"] == 0, details
    assert details["tokens_generated_again"] == len(PROMPTS), details
    assert details["streamed_twice"] == 0 and details["stream_gaps"] == 0, details
