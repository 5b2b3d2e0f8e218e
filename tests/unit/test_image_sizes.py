"""deploy/image-sizes.json (python -m deploy.image_sizes) and the table docs/deployment.md shows."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deploy.image_sizes import DOCS, RESULTS, render


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    found: dict[str, Any] = json.loads(RESULTS.read_text())
    return found


def test_the_docs_table_is_rendered_from_the_results_file(results: dict[str, Any]) -> None:
    page = DOCS.read_text()
    assert render(page, results) == page, "stale: python -m deploy.image_sizes --render"


def test_the_api_environment_was_measured_without_the_worker_extra(
    results: dict[str, Any],
) -> None:
    api, worker = results["images"]["api"], results["images"]["worker"]
    assert api["torch"] is None and api["worker_only_installed"] == []
    assert worker["torch"] and worker["worker_only_installed"] == [
        "torch", "transformers", "onnxruntime",
    ]  # fmt: skip
    assert api["site_packages_mib"] < worker["site_packages_mib"]
    assert results["git"]["commit"] and results["machine"]["cores"] >= 1
