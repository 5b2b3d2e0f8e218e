"""A witness of what a causal LM computed, kept outside the code under test.

The fault suite's generation scenarios count tokens generated again after a
fault from what the model itself was fed, not from what the worker says it
resumed. A ``sitecustomize`` the suite puts on a worker's ``PYTHONPATH``
(:func:`sitecustomize_dir`) calls :func:`install`, which wraps the library's
``LlamaForCausalLM.forward``: every call, once computed, appends one line to
a file of its process's own, naming each sequence the call fed (the position
of its first new token, the new tokens' ids) and whether the call kept the
logits of its last row (to sample from). It is written with one ``os.write``
on a file opened for appending, so a process killed with SIGKILL leaves
every call it completed before, and none it died in.

:func:`generations` reads the calls back as each job's runs: a run starts
where a call fed the job's prompt from position 0, and goes on through the
calls of that process that feed the job's next positions. A run that went
on from a checkpoint prefills the prompt and the tokens before its first
sample; one that started over samples first right after the prompt.

It also injects a lost device when told (:data:`DEVICE_LOSS_ENV` names a
file): the first process whose call finds the file there removes it, and from
that call on every call it makes raises what CUDA raises once its context is
broken, as does its device probe (``torch.cuda.synchronize``): the device is
gone for that process alone, and a process started after it computes again.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import processes

ENV = "FERRY_TEST_LM_WITNESS_DIR"
# A call takes at least this long (as a larger model's would), so that a fault the
# test aims at a generation lands while it runs, however fast the machine.
MIN_CALL_MS_ENV = "FERRY_TEST_LM_MIN_CALL_MS"
# The keyword argument Ferry's step runtime passes its packed layout in.
STEP_KWARG = "ferry_step"
# A file whose appearance loses the device of the first process that sees it.
DEVICE_LOSS_ENV = "FERRY_TEST_LM_DEVICE_LOSS_FILE"
CUDA_ERROR = "CUDA error: an illegal memory access was encountered"


# Prompts for the jobs of one run, each with its own first words: a run of the model is
# told apart from another by the prompt it was fed.
PROMPTS = (
    "alpha when does the ferry leave",
    "bravo the stream is the checkpoint",
    "charlie a worker reads",
    "delta every token goes to the events stream of the job",
    "echo queue",
    "foxtrot the reconciler puts lost entries back",
    "golf tokens",
    "hotel what a generation survives",
)


def install() -> None:
    """Wrap LlamaForCausalLM.forward to record each call (when ENV names a folder), each
    taking at least MIN_CALL_MS_ENV milliseconds."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / f"{os.getpid()}.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    original = LlamaForCausalLM.forward
    min_call_s = float(os.environ.get(MIN_CALL_MS_ENV, "0")) / 1000.0
    loss = os.environ.get(DEVICE_LOSS_ENV)
    calls = 0
    lost = False

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls, lost
        if loss and not lost:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(loss)  # one process wins the removal: its device is lost
                lost = True
                _lose_device()
        if lost:
            raise RuntimeError(CUDA_ERROR)
        began = time.monotonic()
        output = original(self, *args, **kwargs)
        time.sleep(max(0.0, min_call_s - (time.monotonic() - began)))
        # Once computed: a call its process died in computed nothing to witness.
        calls += 1
        line = json.dumps(_call(calls, kwargs), separators=(",", ":")) + "\n"
        os.write(fd, line.encode())
        return output

    LlamaForCausalLM.forward = forward  # type: ignore[method-assign]


def _lose_device() -> None:
    """Every later device probe of this process fails, as on a broken CUDA context."""
    import torch

    def synchronize(device: Any = None) -> None:
        raise RuntimeError(CUDA_ERROR)

    torch.cuda.synchronize = synchronize


def _call(seq: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    ids = [int(t) for t in kwargs["input_ids"][0].tolist()]
    kept = kwargs.get("logits_to_keep")
    rows = {int(r) for r in kept.tolist()} if kept is not None and kept.dim() else set()
    layout = kwargs.get(STEP_KWARG)
    segments = []
    if layout is not None:
        for segment in layout.segments:
            end = segment.offset + segment.length
            segments.append([segment.start, ids[segment.offset : end], end - 1 in rows])
    return {"pid": os.getpid(), "seq": seq, "at": time.time(), "segments": segments}


def sitecustomize_dir(root: Path, repository_root: Path) -> Path:
    """A folder holding a sitecustomize that installs the witness; put it on PYTHONPATH."""
    return processes.sitecustomize_dir(
        root / "lm-witness-site", repository_root, "harness.lm_witness"
    )


@dataclass(frozen=True)
class Call:
    pid: int
    seq: int
    at: float
    segments: tuple[tuple[int, tuple[int, ...], bool], ...]


def read_calls(directory: Path) -> list[Call]:
    """Every call witnessed, in the order made (by time; within a process, by number)."""
    calls = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                raw = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            segments = tuple((int(s), tuple(ids), bool(k)) for s, ids, k in raw["segments"])
            calls.append(Call(raw["pid"], raw["seq"], raw["at"], segments))
    return sorted(calls, key=lambda c: (c.at, c.pid, c.seq))


@dataclass
class Run:
    """One run of a job's generation in one process, by the calls that fed it."""

    pid: int
    reach: int  # positions fed so far
    first_sample: int | None = None  # the position whose logits it sampled first
    last_sample: int | None = None  # ... and last

    def first_generated(self, prompt_tokens: int) -> int | None:
        """The index of the first token this run generated (None: it sampled nothing)."""
        return None if self.first_sample is None else self.first_sample + 1 - prompt_tokens

    def tokens(self, prompt_tokens: int) -> int:
        """How many of the job's tokens existed once this run ended (its own and before)."""
        return 0 if self.last_sample is None else self.last_sample + 2 - prompt_tokens


def generations(calls: Iterable[Call], sequence: Sequence[int], prompt_tokens: int) -> list[Run]:
    """The runs of the job whose whole sequence (prompt, then output) is ``sequence``.

    A call that feeds the job's first tokens from position 0 (two at least: the
    prompts of a scenario differ by their first word) starts a run; a later
    call of the same process feeding the run's next positions with the job's
    tokens goes on with it.
    """
    runs: list[Run] = []
    current: dict[int, Run] = {}
    whole = tuple(sequence)
    for call in calls:
        for start, ids, sampled in call.segments:
            run = current.get(call.pid)
            if start == 0 and len(ids) >= min(2, prompt_tokens) and whole[: len(ids)] == ids:
                run = Run(call.pid, 0)
                current[call.pid] = run
                runs.append(run)
            elif run is None or start != run.reach or whole[start : start + len(ids)] != ids:
                continue
            run.reach = start + len(ids)
            if sampled:
                run.last_sample = run.reach - 1
                if run.first_sample is None:
                    run.first_sample = run.reach - 1
    return runs
