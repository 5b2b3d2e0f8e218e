"""harness.stack's reading of a worker's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from harness.stack import batch_figures_of


def test_batch_figures_are_the_means_of_the_models_own_batches() -> None:
    registry = CollectorRegistry()
    size = Histogram("ferry_batch_size", "", ["model"], registry=registry)
    stage = Histogram("ferry_batch_stage_seconds", "", ["model", "stage"], registry=registry)
    for jobs, prepare, compute in ((32, 0.002, 0.010), (16, 0.004, 0.006)):
        size.labels("minilm").observe(jobs)
        stage.labels("minilm", "prepare").observe(prepare)
        stage.labels("minilm", "compute").observe(compute)
    size.labels("resnet50").observe(8)  # another model's batch counts for nothing here
    stage.labels("resnet50", "prepare").observe(5.0)
    text = generate_latest(registry).decode()

    figures = batch_figures_of(text, "minilm")

    assert figures["batches"] == 2
    assert figures["mean_batch"] == 24.0
    assert figures["stage_ms_per_batch"] == {"compute": 8.0, "prepare": 3.0}


def test_a_worker_that_ran_no_batch_has_no_figures() -> None:
    registry = CollectorRegistry()
    Histogram("ferry_batch_size", "", ["model"], registry=registry)
    figures = batch_figures_of(generate_latest(registry).decode(), "minilm")
    assert figures == {"batches": 0, "mean_batch": 0.0, "stage_ms_per_batch": {}}
