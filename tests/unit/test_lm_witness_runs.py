"""harness.lm_witness reads a job's runs from the calls a model was fed: where each run
sampled first tells a run that went on from a checkpoint from one that started over."""

from __future__ import annotations

from harness.lm_witness import Call, generations

PROMPT = (1, 50, 51, 52)  # BOS and three words
OUTPUT = (7, 8, 9, 10, 11, 12)
OTHER = (1, 60, 61)  # another job's prompt, sharing only the BOS


def call(pid: int, at: float, *segments: tuple[int, tuple[int, ...], bool]) -> Call:
    return Call(pid, int(at), at, segments)


def first_run(pid: int = 100) -> list[Call]:
    """The prompt prefilled beside another job's, then three decodes: tokens 0..3 made."""
    return [
        call(pid, 1, (0, PROMPT, True), (0, OTHER, True)),
        call(pid, 2, (4, (7,), True), (3, (70,), True)),
        call(pid, 3, (5, (8,), True)),
        call(pid, 4, (6, (9,), True)),
    ]


def test_a_run_taken_over_from_its_checkpoint_samples_first_its_last_kept_token() -> None:
    # Process 200 prefills the prompt and tokens 0..1 and samples token 2 again.
    resumed = [
        call(200, 10, (0, PROMPT + OUTPUT[:2], True)),
        call(200, 11, (6, (9,), True)),
        call(200, 12, (7, (10,), True)),
    ]
    runs = generations(first_run() + resumed, PROMPT + OUTPUT, len(PROMPT))
    assert [(r.pid, r.first_generated(len(PROMPT))) for r in runs] == [(100, 0), (200, 2)]
    assert [r.tokens(len(PROMPT)) for r in runs] == [4, 5]


def test_a_run_started_over_samples_first_right_after_the_prompt() -> None:
    again = [call(200, 10, (0, PROMPT, True)), call(200, 11, (4, (7,), True))]
    runs = generations(first_run() + again, PROMPT + OUTPUT, len(PROMPT))
    assert [r.first_generated(len(PROMPT)) for r in runs] == [0, 0]


def test_a_prefill_in_chunks_is_one_run_and_other_jobs_calls_are_not_its() -> None:
    chunked = [
        call(200, 10, (0, PROMPT[:2], False), (0, OTHER, True)),
        call(200, 11, (2, PROMPT[2:] + OUTPUT[:3], True)),
        # Another job's decode at the position this run would go on from: not this run's.
        call(300, 12, (7, (10,), True)),
    ]
    runs = generations(first_run() + chunked, PROMPT + OUTPUT, len(PROMPT))
    assert [(r.pid, r.first_generated(len(PROMPT)), r.reach) for r in runs] == [
        (100, 0, 7),
        (200, 3, 7),
    ]
