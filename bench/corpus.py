"""Real English text that ships with Python: paragraphs of the standard library's docstrings.

Nothing is downloaded. The standard library's modules are parsed with
:mod:`ast`, every module, class and function docstring is split into
paragraphs, and the paragraphs that read as prose (no code examples, mostly
letters, a capital first letter, a final full stop) are kept, deduplicated and
shuffled with a seed. Each text's cost is its all-MiniLM-L6-v2 token count
(:func:`core.models.inputs.count_tokens`, the tokenizer that ships with the model),
capped at 256 tokens, the model's input limit.

The result depends only on the Python version's standard library and the seed.
Reading the standard library takes seconds of CPU, so ``python -m bench all``
has its benchmarks share one reading: it names a folder in
``FERRY_BENCH_CORPUS_CACHE`` for the run, the first benchmark to ask writes the
corpus there, and the others read it. Nothing is kept after the run.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import random
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

MAX_TOKENS = 256
# A folder the benchmarks of one `python -m bench all` run share the corpus through.
CACHE_ENV = "FERRY_BENCH_CORPUS_CACHE"
MIN_CHARS = 40
MAX_CHARS = 1200
_SKIP_DIRS = {"site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}
_CODE_STARTS = (">>>", "...", "$", "%", "#", "|", "+-", "--", "==")


@dataclass(frozen=True)
class Corpus:
    texts: list[str]
    costs: list[int]  # MiniLM tokens of each text, [CLS] and [SEP] included, capped at 256

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.costs):
            raise ValueError("texts and costs differ in length")


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's own modules, tests and bundled packages left out, sorted."""
    base = root if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in base.rglob("*.py"):
        parts = path.relative_to(base).parts
        if any(p in _SKIP_DIRS or p.startswith("test") for p in parts):
            continue
        files.append(path)
    return sorted(files)


def _paragraphs(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                found.extend(re.split(r"\n\s*\n", doc))
    return found


def _prose(paragraph: str) -> str | None:
    """The paragraph on one line if it reads as English prose, else ``None``."""
    lines = [line.strip() for line in paragraph.strip().splitlines()]
    if not lines or any(line.startswith(_CODE_STARTS) for line in lines):
        return None
    text = " ".join(" ".join(lines).split())
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return None
    if not text[0].isupper() or not text.endswith((".", "!", "?")):
        return None
    letters = sum(c.isalpha() or c == " " for c in text)
    if letters < 0.85 * len(text) or len(text.split()) < 6:
        return None
    return text


def shared(
    name: str, compute: Callable[[], T], encode: Callable[[T], Any], decode: Callable[[Any], T]
) -> T:
    """``compute()``, or what another process of the run computed and kept under ``name``
    in the run's folder (``CACHE_ENV``); without the folder, computed here."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return compute()
    path = Path(folder) / f"{name}.json"
    # One process computes while the others wait for its file, rather than all at once.
    with (Path(folder) / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return decode(json.loads(path.read_text(encoding="utf-8")))
        value = compute()
        partial = path.with_suffix(f".{os.getpid()}")
        partial.write_text(json.dumps(encode(value)), encoding="utf-8")
        partial.replace(path)
        return value


def load_texts(seed: int = 0, max_files: int | None = None) -> list[str]:
    """Prose paragraphs of the standard library's docstrings, in a seeded order."""
    return shared(f"texts-{seed}-{max_files}", lambda: read_texts(seed, max_files), list, list)


def read_texts(seed: int = 0, max_files: int | None = None) -> list[str]:
    """:func:`load_texts`, read from the standard library."""
    files = stdlib_files()
    if max_files is not None:
        files = files[:max_files]
    seen: dict[str, None] = {}
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for paragraph in _paragraphs(source):
            text = _prose(paragraph)
            if text is not None:
                seen.setdefault(text, None)
    texts = sorted(seen)  # independent of file-system order
    random.Random(seed).shuffle(texts)
    return texts


def token_costs(texts: list[str]) -> list[int]:
    from backends.catalog import repository_for
    from core.config.settings import Settings
    from core.models.inputs import count_tokens

    tokenizer = repository_for(Settings())["minilm"].tokenizer_path()
    assert tokenizer is not None
    return [min(MAX_TOKENS, count_tokens(text, tokenizer)) for text in texts]


def load_corpus(seed: int = 0, max_files: int | None = None) -> Corpus:
    """The texts and their MiniLM token costs (capped at 256)."""

    def compute() -> Corpus:
        texts = load_texts(seed, max_files)
        return Corpus(texts=texts, costs=token_costs(texts))

    return shared(
        f"corpus-{seed}-{max_files}",
        compute,
        lambda c: {"texts": c.texts, "costs": c.costs},
        lambda d: Corpus(texts=d["texts"], costs=d["costs"]),
    )


def load(seed: int = 0, max_files: int | None = None) -> tuple[list[str], list[int]]:
    """``(texts, costs)``, for callers that want plain lists."""
    corpus = load_corpus(seed, max_files)
    return corpus.texts, corpus.costs
