"""Model backends, by the name ``model.toml`` gives them.

The built-in ones are modules of this package, imported only when a model
names them (and none imports torch before its runtime loads). A package may
add its own through the ``ferry.backends`` entry-point group: the entry's name
is the backend's, its object a :class:`backends.base.Backend`.
"""

from __future__ import annotations

import importlib
from functools import cache
from importlib.metadata import entry_points

from backends.base import Backend

BUILT_IN = {
    "sentence-transformers": "backends.sentence_transformers",
    "hf-classifier": "backends.hf_classifier",
    "torchscript": "backends.torchscript",
    "torch-export": "backends.torchscript",
    "onnx": "backends.onnx",
    "python": "backends.python",
    "torchvision": "backends.torchvision",
    "sim": "backends.sim",
    "causal-lm": "backends.generation",
}
ENTRY_POINT_GROUP = "ferry.backends"


class UnknownBackend(LookupError):
    pass


def names() -> list[str]:
    """Every backend a model.toml may name."""
    return sorted(set(BUILT_IN) | {e.name for e in entry_points(group=ENTRY_POINT_GROUP)})


@cache
def get_backend(name: str) -> Backend:
    module = BUILT_IN.get(name)
    if module is not None:
        backends: dict[str, Backend] = importlib.import_module(module).BACKENDS
        return backends[name]
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            backend: Backend = entry.load()
            return backend
    raise UnknownBackend(f"unknown backend {name!r} (known: {', '.join(names())})")


__all__ = ["Backend", "UnknownBackend", "get_backend", "names"]
