"""Small causal LM folders for the generation tests, built once per test process.

They come from ``ferry.lm_build`` (seeded random weights, a tokenizer trained
on the corpus Ferry ships), so every test loads a real folder with the
library's own ``from_pretrained``; their text is noise.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path

from ferry.lm_build import build_lm

ARCHES = ("gpt2", "llama")
_lock = threading.Lock()
_built: dict[tuple[str, int], Path] = {}
_root: Path | None = None


def lm_folder(arch: str, seed: int = 0) -> Path:
    """The folder of a small ``arch`` model (``gpt2`` or ``llama``), built on first use."""
    global _root
    with _lock:
        key = (arch, seed)
        if key not in _built:
            if _root is None:
                _root = Path(tempfile.mkdtemp(prefix="ferry-lm-"))
                atexit.register(shutil.rmtree, _root, True)
            _built[key] = build_lm(_root / f"{arch}-{seed}", arch, seed=seed)
        return _built[key]
