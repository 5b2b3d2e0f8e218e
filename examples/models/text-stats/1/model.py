"""Version 1 of text-stats: a model for Ferry's python backend.

The class is all Ferry needs: built once per worker with the version's folder,
the model's [parameters] and the device; then ``predict`` takes a whole batch
and returns one JSON value per input, in order. It imports nothing of Ferry.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")
SENTENCE_END = re.compile(r"[.!?]+(?:\s|$)")


class TextStats:
    def __init__(self, files: Path, parameters: dict[str, Any], device: str) -> None:
        self.top_words = int(parameters.get("top_words", 3))
        stop_words = files / "stop_words.txt"
        self.stop_words = set(stop_words.read_text().split()) if stop_words.exists() else set()

    def predict(self, inputs: list[str]) -> list[dict[str, Any]]:
        return [self._one(text) for text in inputs]

    def _one(self, text: str) -> dict[str, Any]:
        words = [w.lower() for w in WORD.findall(text)]
        counted = Counter(w for w in words if w not in self.stop_words)
        return {
            "words": len(words),
            "sentences": max(1, len(SENTENCE_END.findall(text))) if words else 0,
            "characters": len(text),
            "top_words": [w for w, _ in counted.most_common(self.top_words)],
        }
