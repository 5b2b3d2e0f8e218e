"""Generation jobs broken on real processes: a worker killed mid-generation, Redis lost.

The stack serves the llama-shaped test model (``tests.integration.generation_worker``:
seeded random weights, no end-of-sequence token, so every job runs to its
``max_tokens``) through ``python -m ferry worker`` processes. What each
scenario counts comes from witnesses the worker neither writes nor reads:

- the database's transition log (``harness.witness``): lost, written twice;
- the model's own record of what it was fed (``harness.lm_witness``, put in
  the workers by a ``sitecustomize``): each job's runs, and the token each run
  sampled first. A run taken over from the job's checkpoint samples first
  the last token its events stream held (recomputed, not streamed again); a
  run restarted from zero samples first right after the prompt;
- each job's events stream: every token index present once, the running
  events, and how many tokens it held when the job was taken over;
- the library's greedy ``generate()`` on the same folder: the output every job
  must end with.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.models.generation import prompt_token_ids
from core.streams.events import JobEvent
from core.streams.protocol import events_key
from harness import webclient
from harness.accounting import Figures
from harness.faults import Stack
from harness.lm_witness import (
    ENV,
    MIN_CALL_MS_ENV,
    PROMPTS,
    Run,
    generations,
    read_calls,
    sitecustomize_dir,
)
from harness.ports import free_port
from harness.processes import Proc, wait_for
from harness.submitting import Submission
from harness.witness import read_transitions, terminal_writes
from tests.integration.gen_api import EventReader, Message
from tests.integration.generation_worker import MODEL, greedy, repository

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
VISIBILITY_TIMEOUT_S = 2.0
# A generation lasts MAX_TOKENS steps of MIN_STEP_MS at least (over 1.2 s): a fault aimed
# at it once it has streamed a few tokens (8) lands while it runs, even on a loaded machine.
MAX_TOKENS = 64
MIN_STEP_MS = 20


def generation_stack(make_stack: Callable[..., Stack], tmp_path: Path, **env: str) -> Stack:
    """The API and Redis of a stack serving the test model (workers started by the test)."""
    folder = repository(tmp_path, max_running=len(PROMPTS), eos=False)
    stack = make_stack(
        FERRY_MODELS=MODEL,
        FERRY_MODEL_REPOSITORY=str(folder),
        FERRY_VISIBILITY_TIMEOUT_S=str(VISIBILITY_TIMEOUT_S),
        # The reference is computed on the CPU in fp32: so are the workers' steps.
        FERRY_DEVICE="cpu",
        FERRY_CPU_THREADS="1",
        **env,
    )
    stack.start_api()
    return stack


def witness_dir(stack: Stack) -> Path:
    return stack.tmp / "lm-computations"


def witness_env(stack: Stack) -> dict[str, str]:
    """What a worker's environment needs for the model's witness (each step taking
    MIN_STEP_MS at least)."""
    site = sitecustomize_dir(stack.tmp, ROOT)
    path = os.pathsep.join(p for p in (str(site), stack.env.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, ENV: str(witness_dir(stack)), MIN_CALL_MS_ENV: str(MIN_STEP_MS)}


def start_worker(
    stack: Stack,
    name: str,
    wait: bool = True,
    supervised: bool = False,
    env: dict[str, str] | None = None,
) -> Proc:
    """A generation worker process, the model's witness installed in it, ``env`` added."""
    return stack.start_worker(
        name, supervised, wait=wait, model=MODEL, env={**witness_env(stack), **(env or {})}
    )


def folder_of(stack: Stack) -> Path:
    return Path(stack.env["FERRY_MODEL_REPOSITORY"]) / MODEL / "1"


def submit(stack: Stack, prompts: tuple[str, ...]) -> Submission:
    bodies = [
        {"model": MODEL, "input": {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}}
        for p in prompts
    ]
    submission = stack.submit(bodies)
    assert len(submission.accepted) == len(prompts), submission.rejected
    return submission


# The library's greedy outputs, by prompt: every scenario's model folder is made the same
# way (tests.lm's, no end-of-sequence token), so one process computes each prompt's once.
REFERENCES: dict[str, list[int]] = {}
REFERENCES_LOCK = threading.Lock()


def greedy_in_background(stack: Stack, prompts: tuple[str, ...]) -> Future[list[list[int]]]:
    """The library's greedy outputs of the prompts, computed while the scenario runs."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="reference")
    folder = folder_of(stack)

    def outputs() -> list[list[int]]:
        with REFERENCES_LOCK:
            for prompt in prompts:
                if prompt not in REFERENCES:
                    REFERENCES[prompt] = greedy(folder, prompt, MAX_TOKENS)
            return [REFERENCES[prompt] for prompt in prompts]

    future = pool.submit(outputs)
    pool.shutdown(wait=False)
    return future


def events(stack: Stack, job_id: str) -> list[tuple[str, JobEvent]]:
    entries: Any = stack.redis.xrange(events_key(stack.prefix, MODEL, job_id))
    return [(entry_id, JobEvent.decode(fields)) for entry_id, fields in entries]


def streamed(stack: Stack, ids: list[str]) -> dict[str, int]:
    """How many token events each job's stream holds now."""
    pipe = stack.redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.xlen(events_key(stack.prefix, MODEL, job_id))
    # The first event is the running one; the tokens follow (none has ended yet).
    return {job_id: max(0, int(n) - 1) for job_id, n in zip(ids, pipe.execute(), strict=True)}


def wait_generating(stack: Stack, ids: list[str], tokens: int) -> None:
    """Until every job has streamed ``tokens`` tokens; none may have ended by then."""

    def generating() -> bool:
        counts = streamed(stack, ids)
        assert max(counts.values()) < MAX_TOKENS, f"a job ended before the fault: {counts}"
        return min(counts.values()) >= tokens

    wait_for(f"every job to stream {tokens} tokens", generating, 120, 0.01)


@dataclass
class JobCount:
    """What the witnesses say of one job."""

    prompt_tokens: int
    runs: list[Run]
    # Tokens its stream held when a later run started (the checkpoint it could go on from).
    checkpoint: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    matches_reference: bool = False
    stream_matches_output: bool = False
    running_events: int = 0

    def first_generated(self) -> list[int | None]:
        return [run.first_generated(self.prompt_tokens) for run in self.runs]

    def generated_again(self) -> int:
        """Tokens a later run generated that an earlier run of the job had generated."""
        return sum(before - first for before, first in self._later_runs())

    def tokens_lost(self) -> int:
        """Tokens generated again that no checkpoint had kept: those a run made and never
        streamed, or all of them when the stream was lost (the one a run going on from its
        checkpoint recomputes by design is not lost)."""
        return sum(before - first - int(first > 0) for before, first in self._later_runs())

    def _later_runs(self) -> list[tuple[int, int]]:
        """For each run after the first: the tokens made before it, and its first token."""
        found = []
        for i, run in enumerate(self.runs[1:], start=1):
            before = max(r.tokens(self.prompt_tokens) for r in self.runs[:i])
            first = run.first_generated(self.prompt_tokens)
            if first is not None and before > first:
                found.append((before, first))
        return found

    def restarted_from_zero(self) -> bool:
        """A later run began at the first token although earlier runs had made two or more."""
        return any(
            run.first_generated(self.prompt_tokens) == 0
            and max(r.tokens(self.prompt_tokens) for r in self.runs[:i]) >= 2
            for i, run in enumerate(self.runs[1:], start=1)
        )


def account(
    stack: Stack,
    scenario: str,
    submission: Submission,
    prompts: tuple[str, ...],
    reference: Future[list[list[int]]],
    started: float,
    record: Callable[[Figures], None],
    timeout: float = 120,
    **measured: Any,
) -> tuple[Figures, dict[str, Any], dict[str, JobCount]]:
    """Wait for every job to end, then count from the witnesses; ``reference``: the greedy
    outputs of ``prompts``."""
    accepted = submission.accepted
    stack.wait_terminal(accepted, timeout)
    seconds = time.monotonic() - started
    rows = stack.rows(accepted)
    writes = terminal_writes(read_transitions(stack.engine, accepted))
    calls = read_calls(witness_dir(stack))
    folder = folder_of(stack)
    counts: dict[str, JobCount] = {}
    expected = reference.result(timeout=300)
    for job_id, prompt, greedy_tokens in zip(accepted, prompts, expected, strict=True):
        row = rows.get(job_id)
        prompt_ids = prompt_token_ids({"prompt": prompt}, folder / "tokenizer.json")
        output = row.output if row is not None and isinstance(row.output, dict) else {}
        tokens = list(output.get("token_ids", []))
        seen = events(stack, job_id)
        running_at = [entry_id for entry_id, e in seen if e == JobEvent.running()]
        token_events = [(entry_id, e) for entry_id, e in seen if e.kind == "token"]
        count = JobCount(
            len(prompt_ids),
            generations(calls, [*prompt_ids, *tokens], len(prompt_ids)),
            # Entry ids order the stream: the tokens before each later running event.
            checkpoint=[
                sum(1 for entry_id, _ in token_events if _before(entry_id, at))
                for at in running_at[1:]
            ],
            indices=[e.index for _, e in token_events if e.index is not None],
            matches_reference=tokens == greedy_tokens,
            stream_matches_output=[e.token for _, e in token_events] == tokens
            and "".join(e.text or "" for _, e in token_events) == output.get("text"),
            running_events=len(running_at),
        )
        counts[job_id] = count
    terminal = {j for j in accepted if writes.get(j, 0)}
    details: dict[str, Any] = {
        "statuses": {j: rows[j].status for j in accepted if j in rows},
        "attempts": {j: rows[j].attempts for j in accepted if j in rows},
        "runs": {j: len(c.runs) for j, c in counts.items()},
        "first_generated": {j: c.first_generated() for j, c in counts.items()},
        "checkpoint": {j: c.checkpoint for j, c in counts.items()},
        "tokens_generated_again": sum(c.generated_again() for c in counts.values()),
        "tokens_lost": sum(c.tokens_lost() for c in counts.values()),
        "streamed_twice": sum(len(c.indices) - len(set(c.indices)) for c in counts.values()),
        "stream_gaps": sum(len(set(range(MAX_TOKENS)) - set(c.indices)) for c in counts.values()),
        "differs_from_reference": sorted(j for j, c in counts.items() if not c.matches_reference),
        "stream_differs_from_output": sorted(
            j for j, c in counts.items() if not c.stream_matches_output
        ),
        "restarts": {p.name: p.exits for p in stack.procs.values() if p.exits},
        **measured,
    }
    figures = Figures(
        scenario=scenario,
        submitted=len(accepted),
        completed=len(terminal),
        lost=len(accepted) - len(terminal),
        # For a generation: its runs (by the model's witness), the runs after the first
        # (taken over), and the runs that began again from the first token.
        executions=sum(len(c.runs) for c in counts.values()),
        after_crash=sum(max(0, len(c.runs) - 1) for c in counts.values()),
        run_twice=sum(c.restarted_from_zero() for c in counts.values()),
        written_twice=sum(1 for j in accepted if writes.get(j, 0) > 1),
        seconds=round(seconds, 1),
        details=details,
    )
    record(figures)
    return figures, details, counts


def _before(entry_id: str, other: str) -> bool:
    return _entry_order(entry_id) < _entry_order(other)


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def kill_mid_generation(
    make_stack: Callable[..., Stack],
    tmp_path: Path,
    record: Callable[[Figures], None],
    scenario: str,
    prompts: tuple[str, ...],
    restart_same: bool,
) -> None:
    stack = generation_stack(make_stack, tmp_path)
    reference = greedy_in_background(stack, prompts)
    victim = start_worker(stack, "w1")
    started = time.monotonic()
    submission = submit(stack, prompts)
    ids = submission.accepted
    wait_generating(stack, ids, tokens=8)
    stack.kill(victim)
    at_kill = streamed(stack, ids)
    # The same worker started again takes its own entries back at once; another one
    # takes them over once they have been idle for the visibility timeout.
    taker = start_worker(stack, "w1" if restart_same else "w2")
    assert taker.popen is not None
    figures, details, counts = account(
        stack, scenario, submission, prompts, reference, started, record, streamed_at_kill=at_kill
    )
    assert figures.lost == 0 and figures.written_twice == 0, details
    assert set(details["statuses"].values()) == {"succeeded"}, details
    assert set(details["attempts"].values()) == {2}, details  # taken over, once
    assert not details["differs_from_reference"], details
    assert not details["stream_differs_from_output"], details
    for job_id, count in counts.items():
        # Every token once, in order, across the takeover; two starts.
        assert count.indices == list(range(MAX_TOKENS)), (job_id, details)
        assert count.running_events == 2, (job_id, details)
        # The victim's run, then the taker's, which went on from the checkpoint: its first
        # sample is the last token the stream held, computed again.
        assert len(count.runs) == 2, (job_id, details)
        assert count.runs[1].pid == taker.popen.pid, (job_id, details)
        (held,) = count.checkpoint
        assert held >= at_kill[job_id] >= 8, (job_id, details)
        assert count.first_generated()[1] == held - 1, (job_id, details)
    assert figures.run_twice == 0, details
    # Each job: the recomputed last token, and at most one the victim sampled and
    # never streamed (killed between the two), the only token lost.
    assert details["tokens_lost"] <= len(prompts), details
    assert details["tokens_generated_again"] <= 2 * len(prompts), details
    assert details["streamed_twice"] == 0 and details["stream_gaps"] == 0, details


def test_a_generation_worker_killed_mid_generation_is_taken_over_from_the_checkpoint(
    make_stack: Callable[..., Stack], tmp_path: Path, record: Callable[[Figures], None]
) -> None:
    kill_mid_generation(
        make_stack, tmp_path, record, "kill -9 mid-generation, one job", PROMPTS[:1], False
    )


def test_a_full_batch_killed_mid_generation_resumes_on_the_restarted_worker(
    make_stack: Callable[..., Stack], tmp_path: Path, record: Callable[[Figures], None]
) -> None:
    kill_mid_generation(
        make_stack, tmp_path, record, "kill -9 mid-generation, full batch", PROMPTS, True
    )


def test_redis_restarted_empty_mid_generation_loses_no_job_and_starts_them_over(
    make_stack: Callable[..., Stack], tmp_path: Path, record: Callable[[Figures], None]
) -> None:
    """The checkpoints lived in Redis: each job starts over from its prompt, none is lost.

    What Ferry promises when Redis comes back empty: the database has the jobs,
    and the reconciler gives every queued or running one a stream entry again;
    the worker rides the outage out and reads them. The tokens streamed before
    went with Redis, so each job is generated again from its first token (they
    are counted), to the same output, and its new events stream holds every
    token once.
    """
    stack = generation_stack(
        make_stack, tmp_path, FERRY_RECONCILE_INTERVAL_S="1", FERRY_RECONCILE_GRACE_S="2"
    )
    # Supervised, as `ferry up` runs them; the reconciler is the Celery beat's task.
    celery_worker = stack.spawn("celery-worker", ["celery", "worker"], supervised=True)
    beat = stack.spawn("celery-beat", ["celery", "beat"], supervised=True)
    reference = greedy_in_background(stack, PROMPTS)
    worker = start_worker(stack, "w1")
    started = time.monotonic()
    submission = submit(stack, PROMPTS)
    ids = submission.accepted
    wait_generating(stack, ids, tokens=8)
    subscriptions = stack.listener.subscriptions
    at_fault = streamed(stack, ids)
    stack.kill_redis(wipe=True)
    time.sleep(1.0)  # the fault itself: Redis stays down this long
    stack.start_redis()  # same port, empty: every events stream (the checkpoints) gone
    stack.listener.wait_subscribed(subscriptions)
    scenario = "Redis restarted empty mid-generation"
    figures, details, counts = account(
        stack, scenario, submission, PROMPTS, reference, started, record,
        streamed_at_fault=sum(at_fault.values()),
    )  # fmt: skip
    details["reenqueued"] = stack.reenqueued(celery_worker)
    assert figures.lost == 0 and figures.written_twice == 0, details
    assert set(details["statuses"].values()) == {"succeeded"}, details
    assert set(details["attempts"].values()) == {2}, details
    assert details["reenqueued"] >= len(ids), details
    assert not details["differs_from_reference"], details
    assert not details["stream_differs_from_output"], details
    for job_id, count in counts.items():
        # The run before the fault, then one from the first token: nothing to go on from.
        assert len(count.runs) == 2, (job_id, details)
        assert count.first_generated()[1] == 0, (job_id, details)
        # The new stream: the second run's running event and every token once.
        assert count.indices == list(range(MAX_TOKENS)), (job_id, details)
        assert count.running_events == 1, (job_id, details)
    assert figures.run_twice == len(ids), details
    # Every token streamed before the fault was lost, and generated again.
    assert details["tokens_lost"] >= sum(at_fault.values()), details
    assert details["tokens_lost"] == details["tokens_generated_again"], details
    assert worker.alive() and worker.starts == 1
    assert celery_worker.alive() and beat.alive()


@dataclass
class StreamingClient:
    """A client reading one job's events, reconnecting with Last-Event-ID."""

    job_id: str
    token: str
    messages: list[Message] = field(default_factory=list)
    connections: int = 0

    def read(self, base: str) -> bool:
        """Read the events from ``base`` after the last one seen; True once ``done`` came."""
        headers = {"Authorization": f"Bearer {self.token}"}
        seen = [m.id for m in self.messages if m.id is not None]
        if seen:
            headers["Last-Event-ID"] = seen[-1]
        self.connections += 1
        url = f"{base}/v1/jobs/{self.job_id}/events"
        try:
            with httpx.stream("GET", url, headers=headers, timeout=30) as response:
                assert response.status_code == 200, response.read()
                reader = EventReader(response)
                while (message := reader.next()) is not None:
                    self.messages.append(message)
                    if message.event == "done":
                        return True
        except httpx.TransportError:
            pass  # its API died mid-stream: what came whole is kept
        return False

    def tokens(self) -> list[dict[str, Any]]:
        return [m.data for m in self.messages if m.event == "token"]


def read_all(clients: list[StreamingClient], base: str) -> list[bool]:
    with ThreadPoolExecutor(len(clients), thread_name_prefix="sse") as pool:
        return list(pool.map(lambda c: c.read(base), clients))


def test_an_api_killed_mid_stream_the_client_goes_on_from_another_with_last_event_id(
    make_stack: Callable[..., Stack], tmp_path: Path, record: Callable[[Figures], None]
) -> None:
    """kill -9 of the API a client streams a generation's events from: the client reconnects
    to another API process with Last-Event-ID and sees every token once, in order."""
    prompts = PROMPTS[:4]
    stack = generation_stack(make_stack, tmp_path)
    other_port = free_port()
    other = stack.spawn("api-2", ["api"], FERRY_API_PORT=str(other_port))
    reference = greedy_in_background(stack, prompts)
    start_worker(stack, "w1")
    other_base = f"http://127.0.0.1:{other_port}"
    wait_for("the second API", lambda: _ready(other_base), 60)
    started = time.monotonic()
    submission = submit(stack, prompts)
    clients = [StreamingClient(job_id, stack.token) for job_id in submission.accepted]
    with ThreadPoolExecutor(len(clients), thread_name_prefix="sse") as pool:
        first = pool.map(lambda c: c.read(stack.base), clients)
        wait_for(
            "every client to read 8 tokens",
            lambda: min(len(c.tokens()) for c in clients) >= 8,
            120,
            0.01,
        )
        stack.kill(stack.procs["api"])
        ended_early = list(first)
    assert not any(ended_early), "a stream ended before its API was killed"
    before_kill = {c.job_id: len(c.tokens()) for c in clients}
    assert all(read_all(clients, other_base)), [c.messages[-3:] for c in clients]

    repeated = gaps = 0
    for client in clients:
        indices = [t["index"] for t in client.tokens()]
        repeated += len(indices) - len(set(indices))
        gaps += len(set(range(MAX_TOKENS)) - set(indices))
    figures, details, _ = account(
        stack, "API killed mid-stream, client reconnects", submission, prompts, reference,
        started, record,
        client_tokens_before_kill=before_kill, client_saw_twice=repeated, client_gaps=gaps,
        client_connections={c.job_id: c.connections for c in clients},
    )  # fmt: skip
    assert figures.lost == 0 and figures.written_twice == 0, details
    assert repeated == 0 and gaps == 0, details
    assert not details["differs_from_reference"], details
    assert set(details["runs"].values()) == {1}, details  # the worker was not disturbed
    rows = stack.rows(submission.accepted)
    for client in clients:
        row = rows[client.job_id]
        assert row.status == "succeeded" and row.attempts == 1, row
        tokens = client.tokens()
        # Every token once, in order, across the two connections; the text is the output's.
        assert [t["index"] for t in tokens] == list(range(MAX_TOKENS)), client.job_id
        assert [t["token"] for t in tokens] == row.output["token_ids"], client.job_id
        assert "".join(t["text"] for t in tokens) == row.output["text"], client.job_id
        ids = [m.id for m in client.messages if m.id is not None]
        assert ids == sorted(ids, key=_entry_order) and len(set(ids)) == len(ids), ids
        assert client.messages[-1].data == {"status": "succeeded", "finish_reason": "length"}
    assert other.alive()


def _ready(base: str) -> bool:
    try:
        return webclient.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
