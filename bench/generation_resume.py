# ruff: noqa: RUF001
"""A generation whose worker is killed mid-way, taken over from its checkpoint: what it costs.

Every token of a generation goes to the job's Redis events stream in the
step that produced it, so the stream is the checkpoint: a worker that takes
the job over once the dead worker's entry has been idle for the visibility
timeout prefills the prompt and the streamed tokens again, and goes on. This
measures, end to end on real processes, what a crash adds to one job's
latency and how many tokens it costs.

The stack is ``harness.faults.Stack``: a redis-server of its own, a SQLite
file, the API and two ``python -m ferry worker`` processes serving a
llama-shaped model (``ferry.lm_build``, random weights, no end-of-sequence
token, so a job runs to its ``max_tokens``) on the CPU. The model's witness
(``harness.lm_witness``, put in each worker by a ``sitecustomize``) records
every forward call, and makes each last ``MIN_STEP_MS`` at least, so a kill
aimed at the middle of a generation lands there however fast the machine.

Each repeat, on the same stack, with its own prompt:

* **uninterrupted**: one greedy job, both workers up;
* **killed**: the same job again; once its events stream holds half its
  tokens, kill -9 of the worker holding it (the consumer the group's pending
  entry names). The other worker, idle, takes it over after the visibility
  timeout (``VISIBILITY_TIMEOUT_S``). A replacement worker is started and
  warmed before the next repeat, outside the timed part.

A job's latency is the database's: its row's ``created_at`` (the API's
insert) to its ``finished_at`` (the worker's result write). The extra
latency is the killed job's less the uninterrupted one's; less the
visibility timeout, it is what the takeover itself costs. Where that goes,
on the taker's side: from the kill to its log of the takeover
(``kill_to_takeover_s``: the timeout, less up to a quarter of it, since the
victim touched its entry every quarter and the idle time runs from the last
touch, plus up to one of the taker's idle reads, which it looks for idle
entries between), from there to its running event in the stream
(``takeover_to_resume_s``: the claim, and what else the taker's step waits
on before the job's first step), and to its first new token
(``resume_to_first_token_s``: the re-prefill and one step), the last two by
the stream's entry ids (Redis's clock, this machine's). Tokens lost and
generated again are counted from the witness as the fault suite counts them
(``tests/faults/test_generation_faults.py``): the taker's first sample is the
last streamed token, recomputed by design (generated again, not lost); a
token the victim sampled and never streamed is lost. Each repeat also
checks that the killed job's output equals the uninterrupted one's token for
token, and that both streams hold every token index once, in order.

    python -m bench.generation_resume [--repeats 3] [--max-tokens 64] [--smoke]
                                      [--out bench/results/generation_resume.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from bench import results
from bench.generation_workload import ratio_spread
from bench.report import Figure, Fmt, Results, Spread, counted, decimal, measured_on, table
from core.streams.events import JobEvent
from core.streams.protocol import GROUP, events_key
from harness.faults import Stack
from harness.lm_witness import ENV, MIN_CALL_MS_ENV, PROMPTS, Run, generations, read_calls
from harness.lm_witness import sitecustomize_dir as witness_site
from harness.processes import Proc, wait_for

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-lm"
VISIBILITY_TIMEOUT_S = 2.0
# Each forward call lasts this long at least: 64 tokens take over 1.3 s, so a kill
# aimed at the 32nd lands mid-generation even on a loaded machine.
MIN_STEP_MS = 20
SMOKE_MAX_TOKENS = 16
WARM_MAX_TOKENS = 4
TAKEOVER_LOG = "generation taken over from its checkpoint"
WARM_PROMPT = "kilo a first step"
WARM_JOBS_MAX = 12
TOML = """name = "{model}"
backend = "causal-lm"
description = "The resume benchmark's model: random weights."

[input]
kind = "generation"
tokenizer = "tokenizer.json"
default_max_tokens = 16

[cost]
function = "tokens"

[parameters]
max_running = 4
step_tokens = 256
prefill_chunk_tokens = 64
kv_cache_bytes = {kv_bytes}
"""
TIMED = (
    "uninterrupted_s",
    "killed_s",
    "extra_s",
    "extra_less_visibility_s",
    "kill_to_resume_s",
    "kill_to_takeover_s",
    "takeover_to_resume_s",
    "resume_to_first_token_s",
    "streamed_at_kill",
    "checkpoint_tokens",
    "tokens_lost",
    "tokens_generated_again",
)


def build_repository(root: Path) -> Path:
    """The model's repository under ``root`` (one version), its folder naming no EOS."""
    from ferry.lm_build import build_lm

    folder = root / "repository" / MODEL / "1"
    build_lm(folder, "llama", seed=0)
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["eos_token_id"] = []
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    # 512 blocks of 16 tokens of the llama shape build_lm makes by default (4 layers,
    # 2 KV heads of 32 dims, K and V in fp32): room for every job of a repeat.
    kv_bytes = 512 * 16 * 4 * 2 * 32 * 2 * 4
    toml = TOML.format(model=MODEL, kv_bytes=kv_bytes)
    (folder.parent / "model.toml").write_text(toml, encoding="utf-8")
    return folder.parent.parent


# -- counting (pure) ------------------------------------------------------------


def later_runs(runs: Sequence[Run], prompt_tokens: int) -> list[tuple[int, int]]:
    """For each run after the first that began before the tokens already made: how many
    tokens existed before it, and the index of its first token."""
    found = []
    for i, run in enumerate(runs[1:], start=1):
        before = max(r.tokens(prompt_tokens) for r in runs[:i])
        first = run.first_generated(prompt_tokens)
        if first is not None and before > first:
            found.append((before, first))
    return found


def tokens_generated_again(runs: Sequence[Run], prompt_tokens: int) -> int:
    """Tokens a later run generated that an earlier run of the job had generated."""
    return sum(before - first for before, first in later_runs(runs, prompt_tokens))


def tokens_lost(runs: Sequence[Run], prompt_tokens: int) -> int:
    """Tokens generated again that no checkpoint had kept: the one a run going on from its
    checkpoint recomputes (its first sample, the last token streamed) is not lost; a run
    that began from the first token lost everything before it."""
    return sum(before - first - int(first > 0) for before, first in later_runs(runs, prompt_tokens))


def entry_seconds(entry_id: str) -> float:
    """The Redis server's time (Unix seconds) an entry id was made at."""
    return int(entry_id.split("-")[0]) / 1000.0


@dataclass(frozen=True)
class Stream:
    """What a job's events stream holds, in order."""

    indices: list[int]
    tokens: list[int]
    # For each run after the first (a running event after the first): when it began, the
    # tokens the stream held then, and when its first token came (None: it streamed none).
    resumed_at: list[float]
    checkpoints: list[int]
    first_token_at: list[float | None]

    @classmethod
    def of(cls, entries: Sequence[tuple[str, JobEvent]]) -> Stream:
        """From the stream's entries (id, event), in the stream's order."""
        indices: list[int] = []
        tokens: list[int] = []
        resumed_at: list[float] = []
        checkpoints: list[int] = []
        first_token_at: list[float | None] = []
        runs = 0
        for entry_id, event in entries:
            if event == JobEvent.running():
                runs += 1
                if runs > 1:
                    resumed_at.append(entry_seconds(entry_id))
                    checkpoints.append(len(tokens))
                    first_token_at.append(None)
            elif event.kind == "token":
                indices.append(event.index if event.index is not None else -1)
                tokens.append(event.token if event.token is not None else -1)
                if first_token_at and first_token_at[-1] is None:
                    first_token_at[-1] = entry_seconds(entry_id)
        return cls(indices, tokens, resumed_at, checkpoints, first_token_at)

    def every_index_once(self, max_tokens: int) -> bool:
        return self.indices == list(range(max_tokens))


@dataclass(frozen=True)
class Uninterrupted:
    job_id: str
    worker: str
    latency_s: float
    tokens: list[int]
    every_index_once: bool
    runs: int


@dataclass(frozen=True)
class Killed:
    job_id: str
    victim: str
    taker: str
    latency_s: float
    tokens: list[int]
    every_index_once: bool
    runs: int  # by the witness: the victim's, then the taker's
    taker_ran_it: bool  # the witness's second run was the standby's process
    streamed_at_kill: int
    checkpoint_tokens: int | None  # what the stream held when the taker began
    taker_first_token: int | None  # the index of the taker's first sample
    kill_to_resume_s: float | None  # the kill to the taker's running event
    kill_to_takeover_s: float | None  # ... to the taker's log of the takeover
    takeover_to_resume_s: float | None
    resume_to_first_token_s: float | None
    tokens_lost: int
    tokens_generated_again: int
    attempts: int


@dataclass
class Repeat:
    """One repeat's figures (repeat_figures writes them)."""

    job_ids: dict[str, str]  # uninterrupted, killed
    uninterrupted_worker: str
    victim: str
    taker: str
    uninterrupted_s: float
    killed_s: float
    extra_s: float
    extra_less_visibility_s: float
    kill_to_resume_s: float | None  # None: the logs did not say
    kill_to_takeover_s: float | None
    takeover_to_resume_s: float | None
    resume_to_first_token_s: float | None
    streamed_at_kill: int
    checkpoint_tokens: int | None
    taker_first_token: int | None
    tokens_lost: int
    tokens_generated_again: int
    runs: dict[str, int]  # by the witness: uninterrupted, killed
    attempts: int
    taker_ran_it: bool
    output_equal: bool
    every_index_once: bool


@dataclass
class Checks:
    repeats: int
    output_equal: int  # of the repeats
    every_index_once: int
    taken_over_once: int


@dataclass
class Report:
    """bench/results/generation_resume.json besides its head (bench.report.typed reads it)."""

    repeats: list[Repeat]
    uninterrupted_s: Spread
    killed_s: Spread
    extra_s: Spread
    extra_less_visibility_s: Spread
    kill_to_resume_s: Spread
    kill_to_takeover_s: Spread
    takeover_to_resume_s: Spread
    resume_to_first_token_s: Spread
    streamed_at_kill: Spread
    checkpoint_tokens: Spread
    tokens_lost: Spread
    tokens_generated_again: Spread
    killed_over_uninterrupted: Spread
    checks: Checks
    seconds: float = 0.0  # written with the last repeat's file


RESULT = Report


def repeat_figures(
    plain: Uninterrupted, killed: Killed, visibility_timeout_s: float
) -> dict[str, Any]:
    """One repeat's figures: both jobs' latencies, what the kill added, and the checks."""
    extra = killed.latency_s - plain.latency_s
    return {
        "job_ids": {"uninterrupted": plain.job_id, "killed": killed.job_id},
        "uninterrupted_worker": plain.worker,
        "victim": killed.victim,
        "taker": killed.taker,
        "uninterrupted_s": round(plain.latency_s, 3),
        "killed_s": round(killed.latency_s, 3),
        "extra_s": round(extra, 3),
        "extra_less_visibility_s": round(extra - visibility_timeout_s, 3),
        "kill_to_resume_s": _rounded(killed.kill_to_resume_s),
        "kill_to_takeover_s": _rounded(killed.kill_to_takeover_s),
        "takeover_to_resume_s": _rounded(killed.takeover_to_resume_s),
        "resume_to_first_token_s": _rounded(killed.resume_to_first_token_s),
        "streamed_at_kill": killed.streamed_at_kill,
        "checkpoint_tokens": killed.checkpoint_tokens,
        "taker_first_token": killed.taker_first_token,
        "tokens_lost": killed.tokens_lost,
        "tokens_generated_again": killed.tokens_generated_again,
        "runs": {"uninterrupted": plain.runs, "killed": killed.runs},
        "attempts": killed.attempts,
        "taker_ran_it": killed.taker_ran_it,
        "output_equal": killed.tokens == plain.tokens and len(plain.tokens) > 0,
        "every_index_once": plain.every_index_once and killed.every_index_once,
    }


def takeover_at(records: Sequence[dict[str, Any]], job_id: str) -> float | None:
    """When a worker's log says it took the job over from its checkpoint (Unix seconds)."""
    for record in records:
        if record.get("msg") == TAKEOVER_LOG and record.get("job_id") == job_id:
            return dt.datetime.fromisoformat(str(record["ts"])).timestamp()
    return None


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def figures(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median and range over the repeats, and how many repeats passed each
    check."""
    out: dict[str, Any] = {
        name: results.spread(
            [float(r[name]) if r[name] is not None else float("nan") for r in repeats]
        )
        for name in TIMED
    }
    out["killed_over_uninterrupted"] = ratio_spread(
        [r["killed_s"] for r in repeats], [r["uninterrupted_s"] for r in repeats]
    )
    out["checks"] = {
        "repeats": len(repeats),
        "output_equal": sum(1 for r in repeats if r["output_equal"]),
        "every_index_once": sum(1 for r in repeats if r["every_index_once"]),
        "taken_over_once": sum(
            1 for r in repeats if r["runs"]["killed"] == 2 and r["taker_ran_it"]
        ),
    }
    return out


# -- the stack ----------------------------------------------------------------------


class ResumeStack:
    """The stack, its two workers (the witness in each), and the jobs it runs one by one."""

    def __init__(self, root: Path, repository: Path, max_tokens: int) -> None:
        from core.db import migrate

        url = f"sqlite:///{root / 'ferry.db'}"
        migrate.upgrade(url)
        self.max_tokens = max_tokens
        self.stack = Stack(
            root,
            url,
            {
                "FERRY_MODELS": MODEL,
                "FERRY_MODEL_REPOSITORY": str(repository),
                "FERRY_VISIBILITY_TIMEOUT_S": str(VISIBILITY_TIMEOUT_S),
                "FERRY_DEVICE": "cpu",
                "FERRY_CPU_THREADS": "1",
            },
        )
        self.folder = repository / MODEL / "1"
        self.witness = root / "lm-computations"
        self.workers: list[Proc] = []
        self.started = 0

    def start(self) -> None:
        api = self.stack.start_api(wait=False)
        self.start_workers(2)
        self.stack.wait_api(api)
        self.warm()

    def close(self) -> None:
        self.stack.close()

    def start_workers(self, count: int) -> None:
        """Workers named afresh: a dead worker's heartbeat outlives it for a while, and a
        new one under its name would be taken as started at once."""
        site = witness_site(self.stack.tmp, ROOT)
        path = os.pathsep.join(p for p in (str(site), self.stack.env.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, ENV: str(self.witness), MIN_CALL_MS_ENV: str(MIN_STEP_MS)}
        new = []
        for _ in range(count):
            self.started += 1
            name = f"w{self.started}"
            new.append(self.stack.start_worker(name, wait=False, model=MODEL, env=env))
        for proc in new:
            self.stack.wait_worker(proc, MODEL)
        self.workers.extend(new)

    def warm(self) -> None:
        """Short jobs one after the other until every worker has run one (by the witness):
        none is timed on its first steps."""
        for _ in range(WARM_JOBS_MAX):
            ran = {call.pid for call in read_calls(self.witness)}
            if all(w.popen is not None and w.popen.pid in ran for w in self.workers):
                return
            self.wait(self.submit(WARM_PROMPT, WARM_MAX_TOKENS))
        raise RuntimeError(f"a worker took none of {WARM_JOBS_MAX} jobs in a row")

    def submit(self, prompt: str, max_tokens: int) -> str:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        submission = self.stack.submit([{"model": MODEL, "input": body}])
        if len(submission.accepted) != 1:
            raise RuntimeError(f"the job was not accepted: {submission.rejected}")
        return submission.accepted[0]

    def wait(self, job_id: str, timeout: float = 120.0) -> None:
        if not self.stack.wait_terminal([job_id], timeout):
            raise RuntimeError(f"job {job_id} did not end in {timeout:.0f} s")

    def row(self, job_id: str) -> Any:
        from core.db.schema import Job

        with self.stack.engine.connect() as conn:
            return conn.execute(
                select(Job.status, Job.attempts, Job.output, Job.created_at, Job.finished_at).where(
                    Job.id == job_id
                )
            ).one()

    def finished(self, job_id: str) -> tuple[float, list[int], int]:
        """The job's latency (created -> finished), output tokens and attempts; it must
        have succeeded."""
        row = self.row(job_id)
        if row.status != "succeeded" or row.finished_at is None:
            raise RuntimeError(f"job {job_id} ended {row.status}:\n{self.stack.diagnostics()}")
        latency = (row.finished_at - row.created_at).total_seconds()
        tokens = [int(t) for t in (row.output or {}).get("token_ids", [])]
        return latency, tokens, int(row.attempts)

    def stream(self, job_id: str) -> Stream:
        entries: Any = self.stack.redis.xrange(events_key(self.stack.prefix, MODEL, job_id))
        return Stream.of([(i, JobEvent.decode(fields)) for i, fields in entries])

    def streamed(self, job_id: str) -> int:
        """Token events in the job's stream now (the first event is the running one)."""
        return max(0, int(self.stack.redis.xlen(events_key(self.stack.prefix, MODEL, job_id))) - 1)

    def holder(self) -> str | None:
        """The consumer the group's pending entry names (one job in flight)."""
        from core.streams.queues import model_streams

        for stream in model_streams(self.stack.redis, self.stack.prefix, MODEL):
            pending: Any = self.stack.redis.xpending_range(stream, GROUP, "-", "+", 10)
            for entry in pending:
                return str(entry["consumer"])
        return None

    def runs(self, prompt: str, tokens: list[int], since: float) -> tuple[list[Run], int]:
        """The witness's runs of the job (calls made since ``since``), and its prompt's
        length in tokens."""
        from core.models.generation import prompt_token_ids

        prompt_ids = prompt_token_ids({"prompt": prompt}, self.folder / "tokenizer.json")
        calls = [c for c in read_calls(self.witness) if c.at >= since]
        return generations(calls, [*prompt_ids, *tokens], len(prompt_ids)), len(prompt_ids)

    def uninterrupted(self, prompt: str) -> Uninterrupted:
        since = time.time()
        job_id = self.submit(prompt, self.max_tokens)
        wait_for("the job to be read", lambda: self.holder() is not None, 60, 0.005)
        worker = self.holder() or ""
        self.wait(job_id)
        latency, tokens, _ = self.finished(job_id)
        runs, _ = self.runs(prompt, tokens, since)
        stream = self.stream(job_id)
        return Uninterrupted(
            job_id, worker, latency, tokens, stream.every_index_once(self.max_tokens), len(runs)
        )

    def killed(self, prompt: str) -> Killed:
        since = time.time()
        job_id = self.submit(prompt, self.max_tokens)
        half = self.max_tokens // 2

        def halfway() -> bool:
            streamed = self.streamed(job_id)
            if streamed >= self.max_tokens:
                raise RuntimeError("the job ended before the kill")
            return streamed >= half

        wait_for(f"the job to stream {half} tokens", halfway, 60, 0.002)
        victim_name = self.holder()
        victim = next((w for w in self.workers if w.name == victim_name), None)
        if victim is None or victim.popen is None:
            raise RuntimeError(f"no worker of ours holds the job: {victim_name}")
        killed_at = time.time()
        self.stack.kill(victim)
        at_kill = self.streamed(job_id)
        self.workers.remove(victim)
        (taker,) = self.workers
        self.wait(job_id)
        latency, tokens, attempts = self.finished(job_id)
        runs, prompt_tokens = self.runs(prompt, tokens, since)
        stream = self.stream(job_id)
        resumed = stream.resumed_at[0] if stream.resumed_at else None
        first_new = stream.first_token_at[0] if stream.first_token_at else None
        taken = takeover_at(self.stack.log_lines(taker), job_id)
        return Killed(
            job_id=job_id,
            victim=victim.name,
            taker=taker.name,
            latency_s=latency,
            tokens=tokens,
            every_index_once=stream.every_index_once(self.max_tokens),
            runs=len(runs),
            taker_ran_it=len(runs) == 2
            and runs[0].pid == victim.popen.pid
            and taker.popen is not None
            and runs[1].pid == taker.popen.pid,
            streamed_at_kill=at_kill,
            checkpoint_tokens=stream.checkpoints[0] if stream.checkpoints else None,
            taker_first_token=runs[1].first_generated(prompt_tokens) if len(runs) > 1 else None,
            kill_to_resume_s=None if resumed is None else resumed - killed_at,
            kill_to_takeover_s=None if taken is None else taken - killed_at,
            takeover_to_resume_s=None if taken is None or resumed is None else resumed - taken,
            resume_to_first_token_s=(
                None if resumed is None or first_new is None else first_new - resumed
            ),
            tokens_lost=tokens_lost(runs, prompt_tokens),
            tokens_generated_again=tokens_generated_again(runs, prompt_tokens),
            attempts=attempts,
        )

    def replace_killed(self) -> None:
        """A worker in place of the one killed, warmed with the standby."""
        self.start_workers(2 - len(self.workers))
        self.warm()


def one_repeat(stack: ResumeStack, prompt: str) -> dict[str, Any]:
    plain = stack.uninterrupted(prompt)
    killed = stack.killed(prompt)
    found = repeat_figures(plain, killed, VISIBILITY_TIMEOUT_S)
    print(
        f"  uninterrupted {found['uninterrupted_s']:6.3f} s  killed {found['killed_s']:6.3f} s  "
        f"extra {found['extra_s']:6.3f} s "
        f"(less the timeout {found['extra_less_visibility_s']:+.3f})  "
        f"kill at {found['streamed_at_kill']} tokens, lost {found['tokens_lost']}, "
        f"again {found['tokens_generated_again']}  output equal {found['output_equal']}  "
        f"every index once {found['every_index_once']}",
        flush=True,
    )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="one repeat of a short job")
    parser.add_argument("--out", type=Path, default=Path("bench/results/generation_resume.json"))
    args = parser.parse_args(argv)
    smoke = args.smoke or os.environ.get(results.SMOKE_ENV) == "1"
    if smoke:
        args.repeats, args.max_tokens = 1, min(args.max_tokens, SMOKE_MAX_TOKENS)
    if not 1 <= args.repeats <= len(PROMPTS):
        parser.error(f"--repeats must be from 1 to {len(PROMPTS)}")
    if args.max_tokens < 8:
        parser.error("--max-tokens must be at least 8 (the kill lands at half)")
    head = results.provenance("generation_resume", argv)
    head["smoke"] = smoke
    settings = {
        "smoke": smoke,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "kill_at_tokens": args.max_tokens // 2,
        "visibility_timeout_s": VISIBILITY_TIMEOUT_S,
        "min_step_ms": MIN_STEP_MS,
        "model": {"arch": "llama", "built_by": "ferry.lm_build (seed 0, no EOS)"},
        "device": "cpu",
        "threads_per_worker": 1,
        "workers": 2,
        "latency": "the database's: the job row's created_at to its finished_at",
        "stack": "harness.faults.Stack: its own Redis and SQLite, the API, two workers",
    }
    started = time.monotonic()
    repeats: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ferry-bench-resume-") as tmp:
        repository = build_repository(Path(tmp))
        stack = ResumeStack(Path(tmp), repository, args.max_tokens)
        try:
            stack.start()
            for number, prompt in enumerate(PROMPTS[: args.repeats], start=1):
                print(f"repeat {number} of {args.repeats}", flush=True)
                repeats.append(one_repeat(stack, prompt))
                if number < args.repeats:  # the last needs no worker in place of its victim
                    stack.replace_killed()
                report = {"repeats": repeats, **figures(repeats)}
                # Written after every repeat: a run cut short still leaves what it measured.
                results.write(args.out, report, settings=settings, head=head)
        finally:
            stack.close()
    report["seconds"] = round(time.monotonic() - started, 1)
    results.write(args.out, report, settings=settings, head=head)
    extra, lost = report["extra_s"], report["tokens_lost"]
    print(
        f"a kill mid-generation adds {extra['median']:.2f} s "
        f"({extra['min']:.2f}-{extra['max']:.2f}) with a {VISIBILITY_TIMEOUT_S:.0f} s "
        f"visibility timeout; tokens lost per crash "
        f"{lost['median']:.0f} ({lost['min']:.0f}-{lost['max']:.0f}); "
        f"wrote {args.out} in {report['seconds']:.0f} s"
    )
    return 0


# --- its tables (python -m bench.render) --------------------------------------------------


def render_generation_resume(results: Results) -> list[str]:
    doc, report = results["generation_resume"], results.typed("generation_resume", Report)
    s, checks = doc["settings"], report.checks
    sec = decimal(2, " s")

    def fig(name: str, fmt: Fmt = sec, bold: bool = False) -> str:
        return Figure.summary(getattr(report, name)).text(fmt, bold)

    visibility = f"{s['visibility_timeout_s']:g} s"
    rows = [
        ["the job uninterrupted", fig("uninterrupted_s")],
        [f"its worker killed after {s['kill_at_tokens']} tokens", fig("killed_s")],
        ["extra latency", fig("extra_s", bold=True)],
        [f"of which past the visibility timeout ({visibility})", fig("extra_less_visibility_s")],
        ["kill → another worker takes the entry over", fig("kill_to_takeover_s")],
        ["takeover → the job running again", fig("takeover_to_resume_s")],
        ["running again → its first new token", fig("resume_to_first_token_s")],
        ["tokens lost per crash", fig("tokens_lost", decimal(), bold=True)],
        ["tokens generated again (the last streamed, recomputed)",
         fig("tokens_generated_again", decimal())],
    ]  # fmt: skip
    n = checks.repeats
    return [
        f"{measured_on(doc)}; median of "
        f"{counted(n, 'repeat', 'repeats')} (min–max). {s['workers']} generation workers "
        f"on `{s['device']}` ({s['stack']}); one greedy job of {s['max_tokens']} tokens, "
        f"each step held to {s['min_step_ms']} ms at least; latency is "
        f"{s['latency']}.",
        "",
        *table(["", "seconds or tokens"], "lr", rows),
        "",
        f"Output equal to the uninterrupted run's, token for token: {checks.output_equal} "
        f"of {n}; every token index once in the stream: {checks.every_index_once} of {n}; "
        f"taken over exactly once: {checks.taken_over_once} of {n}.",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
