"""A version on trial (workers/gpu/probation.py): held, kept or rolled back by its batches."""

from __future__ import annotations

from typing import Any, cast

from workers.gpu.device import Computed, InFlight
from workers.gpu.execute import ItemResult
from workers.gpu.probation import Probation, Verdict
from workers.gpu.versions import Loaded


def batch(*ok: bool) -> tuple[InFlight, Computed]:
    results = [
        ItemResult(ok=True, output=1) if good else ItemResult(ok=False, error="RuntimeError: no")
        for good in ok
    ]
    flight = cast(InFlight, object())
    return flight, Computed(results, 0.01, 0.01, 1.0, None)


def trial(failures: int = 3) -> Probation:
    return Probation(Loaded(1, cast(Any, object())), failures)


def test_batches_failed_whole_are_held_until_the_limit_rolls_the_version_back() -> None:
    probation = trial(3)
    assert probation.judge(*batch(False, False)) is Verdict.HOLD
    assert probation.judge(*batch(False)) is Verdict.HOLD
    assert not probation.failed
    assert probation.judge(*batch(False, False, False)) is Verdict.ROLL_BACK
    assert probation.failed and len(probation.held) == 3
    assert probation.reason(2) == (
        "every job of its first 3 batches failed; rolled back to version 1 "
        "(version 2: RuntimeError: no)"
    )


def test_a_batch_with_one_job_computed_keeps_the_version_and_hands_back_the_held() -> None:
    probation = trial(2)
    held = batch(False)
    assert probation.judge(*held) is Verdict.HOLD
    assert probation.judge(*batch(False, True)) is Verdict.PASS
    assert probation.ended() == [held]
    assert probation.held == [] and not probation.failed
