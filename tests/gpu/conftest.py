"""GPU tests: they run only where PyTorch sees a CUDA device, and are skipped elsewhere."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run pytest tests/gpu on a GPU machine")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
