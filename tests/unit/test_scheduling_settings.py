"""Every scheduler knob in the settings reaches the scheduler, per model."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from core.config.settings import Settings
from scheduler import policy_for
from scheduler.learning import KNOBS as KNOBS_OF_TUNING
from scheduler.learning import Tuning
from workers.gpu.scheduling import tuning_for


class Declared:
    """The little a runtime tells the scheduler about itself."""

    padded = True

    def memory_budget_bytes(self) -> float:
        return 2.0**30


KNOBS = {
    "batch_max_size": 64,
    "batch_max_cost": 4096,
    "batch_window_min_ms": 1.0,
    "batch_window_max_ms": 30.0,
    "latency_target_ms": 80.0,
    "memory_threshold": 0.7,
    "bulk_share": 0.1,
    "bulk_ride_factor": 1.5,
    "batch_window_start_factor": 2.0,
    "batch_window_shrink": 0.7,
    "batch_window_grow": 1.3,
    "latency_high_factor": 1.5,
    "latency_low_factor": 0.5,
    "batch_cost_history_weight": 0.6,
    "idle_queue_max": 3,
    "learning_forget": 0.9,
    "oom_backoff": 0.8,
    "urgent_guard": 2.0,
    "urgent_budget": 3.0,
    "urgent_memory_s": 0.5,
    "batch_min_efficiency": 0.85,
}


def test_every_tuning_field_comes_from_a_per_model_setting() -> None:
    settings = Settings(model_settings={"minilm": KNOBS}).for_model("minilm")
    tuning = tuning_for(settings.tuning, Declared())  # type: ignore[arg-type]
    defaults = Tuning()
    for field in dataclasses.fields(Tuning):
        if field.name in ("padded", "memory_budget_bytes"):
            continue  # the runtime's own
        assert getattr(tuning, field.name) != getattr(defaults, field.name), field.name
    assert tuning.padded and tuning.memory_budget_bytes == 2.0**30
    assert tuning.batch_window_max_ms == pytest.approx(30.0)
    assert tuning.latency_target_ms == pytest.approx(80.0)
    assert tuning.batch_min_efficiency == 0.85


def test_other_models_keep_the_shared_settings() -> None:
    settings = Settings(model_settings={"minilm": KNOBS}).for_model("sim")
    # Not minilm's 64: the shared default, unset (each model's worker derives its own).
    assert tuning_for(settings.tuning, Declared()).batch_max_size is None  # type: ignore[arg-type]


def test_an_unknown_policy_is_refused() -> None:
    from scheduler.learning import SchedulerState

    with pytest.raises(ValueError, match="unknown scheduler"):
        policy_for("fifo", SchedulerState.create(Tuning()), 0.005)


def test_each_knob_has_the_name_and_the_default_of_its_setting() -> None:
    """One name per knob, from FERRY_<NAME> to the policy, and one default."""
    settings = Settings()
    for name in KNOBS_OF_TUNING:
        assert name in Settings.model_fields, name
        default = getattr(settings, name)
        assert getattr(Tuning(), name) == default, name
    assert set(KNOBS) == set(KNOBS_OF_TUNING), "every knob is tested above"


def test_every_knob_can_be_set_per_model() -> None:
    from core.config.settings import PER_MODEL

    assert set(KNOBS_OF_TUNING) <= PER_MODEL


def test_each_knob_setting_takes_its_bounds_and_description_from_the_knob() -> None:
    """The one definition: a value outside a knob's bounds is refused as FERRY_<NAME>, and
    the setting's description (its row in docs/settings.md) is the knob's."""
    from pydantic import ValidationError

    knobs = [f for f in dataclasses.fields(Tuning) if "knob" in f.metadata]
    assert [f.name for f in knobs] == list(KNOBS_OF_TUNING)
    for knob in knobs:
        spec = knob.metadata["knob"]
        assert Settings.model_fields[knob.name].description == inspect.cleandoc(spec.doc)
        outside = {"ge": -1, "gt": 0, "le": 1, "lt": 0}
        for bound, step in outside.items():
            value = getattr(spec, bound)
            if value is None:
                continue
            with pytest.raises(ValidationError, match=knob.name):
                Settings(**{knob.name: value + step})
