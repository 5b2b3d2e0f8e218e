"""The causal LMs Ferry builds: real Hugging Face folders that the library loads and runs,
byte-identical for one seed, with a byte-level tokenizer and (llama) a ChatML template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

from ferry import lm_build
from ferry.cli import main
from ferry.lm_build import build_lm, corpus_text, parameter_count, train_tokenizer

FILES = {
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
VOCAB = 1024


def build_small(dest: Path, arch: str, seed: int = 0) -> Path:
    """Small enough to build in a fraction of a second; the CLI's tests build the defaults."""
    return build_lm(
        dest, arch, seed=seed, layers=2, hidden=64, heads=4, vocab_size=VOCAB, context_tokens=256
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm")
    return {arch: build_small(root / arch, arch) for arch in lm_build.ARCHES}


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.mark.parametrize("arch", lm_build.ARCHES)
def test_the_folder_loads_and_generates_greedily(built: dict[str, Path], arch: str) -> None:
    folder = built[arch]
    assert {p.name for p in folder.iterdir()} == FILES
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer) == VOCAB
    prompt = tokenizer("A ferry leaves when it is full", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    prompt_tokens = prompt["input_ids"].shape[1]
    assert torch.equal(out[0, :prompt_tokens], prompt["input_ids"][0])
    assert prompt_tokens < out.shape[1] <= prompt_tokens + 6
    assert int(out.min()) >= 0 and int(out.max()) < len(tokenizer)
    again = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, again)  # greedy: the same tokens every time


def test_gpt2_has_its_shape_and_one_special_token(built: dict[str, Path]) -> None:
    config = json.loads((built["gpt2"] / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["n_head"]) == (2, 64, 4)
    assert config["n_positions"] == 256
    tokenizer = AutoTokenizer.from_pretrained(built["gpt2"])
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id == end
    assert (config["bos_token_id"], config["eos_token_id"]) == (end, end)
    generation = json.loads((built["gpt2"] / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (end, end)
    assert generation["pad_token_id"] == end
    assert tokenizer.chat_template is None
    assert tokenizer("text")["input_ids"][0] != end  # GPT-2 adds no token to a text


def test_llama_has_grouped_query_attention_and_its_special_tokens(
    built: dict[str, Path],
) -> None:
    config = json.loads((built["llama"] / "config.json").read_text())
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    assert config["hidden_act"] == "silu" and config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == 256
    tokenizer = AutoTokenizer.from_pretrained(built["llama"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>", "<|im_end|>")}
    assert len(set(ids.values())) == 4 and tokenizer.unk_token_id not in ids.values()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (ids["<s>"], ids["</s>"])
    assert tokenizer.pad_token_id == ids["<pad>"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (ids["<s>"], ids["</s>"])
    assert config["pad_token_id"] == ids["<pad>"]
    generation = json.loads((built["llama"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["</s>"], ids["<|im_end|>"]]
    assert (generation["bos_token_id"], generation["pad_token_id"]) == (ids["<s>"], ids["<pad>"])
    assert tokenizer("text")["input_ids"][0] == ids["<s>"]  # as Llama's tokenizer does


def test_the_chat_template_renders_chatml_and_ends_with_the_assistant_prompt(
    built: dict[str, Path],
) -> None:
    stored = json.loads((built["llama"] / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in stored["chat_template"]
    tokenizer = AutoTokenizer.from_pretrained(built["llama"])
    messages = [
        {"role": "system", "content": "You ferry jobs."},
        {"role": "user", "content": "When does it leave?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou ferry jobs.<|im_end|>\n"
        "<|im_start|>user\nWhen does it leave?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert isinstance(encoded, BatchEncoding)
    ids = list(encoded["input_ids"])
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # one token each
    assert tokenizer.decode(ids) == text
    closed = tokenizer.apply_chat_template(messages, tokenize=False)
    assert isinstance(closed, str)
    assert closed.endswith("<|im_end|>\n")


@pytest.mark.parametrize("arch", lm_build.ARCHES)
def test_the_tokenizer_gives_back_the_text_it_encoded(built: dict[str, Path], arch: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built[arch])
    corpus = corpus_text()
    unseen = "  tabs\tand ünïcode, §5 \u00d7 2 🚢\n"  # bytes the corpus may never have had
    samples = [corpus[:3000], corpus[len(corpus) // 2 :][:3000], unseen]
    for text in samples:
        ids = tokenizer.encode(text)
        assert len(ids) < len(text.encode())  # merges learned: fewer tokens than bytes
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        plain = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(plain) == text


def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_weights(
    built: dict[str, Path], tmp_path: Path
) -> None:
    again = build_small(tmp_path / "again", "llama")
    assert digests(again) == digests(built["llama"])
    other = digests(build_small(tmp_path / "other", "llama", seed=1))
    same = digests(built["llama"])
    assert other["model.safetensors"] != same["model.safetensors"]
    assert other["tokenizer.json"] == same["tokenizer.json"]  # the tokenizer has no seed
    assert other["README.md"] != same["README.md"]  # it names the seed


def test_tokenizer_training_is_deterministic() -> None:
    first = train_tokenizer("llama", 1024)
    assert first.to_str() == train_tokenizer("llama", 1024).to_str()
    assert first.get_vocab_size() == 1024


def test_the_readme_says_the_weights_are_random_and_how_to_rebuild(
    built: dict[str, Path],
) -> None:
    text = (built["llama"] / "README.md").read_text()
    assert "random" in text and "noise" in text and "real model" in text
    assert (
        "ferry models build-lm DEST --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 "
        "--intermediate 192 --vocab-size 1024 --context-tokens 256 --dtype float32 --seed 0"
    ) in text


def test_parameter_count_reads_the_weights(built: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(built["llama"])
    assert parameter_count(built["llama"]) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("arch", "dimensions", "message"),
    [
        ("gpt3", {}, "arch 'gpt3'"),
        ("llama", {"hidden": 100, "heads": 8}, "not a multiple of heads"),
        ("llama", {"heads": 8, "kv_heads": 3}, "not a multiple of kv_heads"),
        ("gpt2", {"heads": 8, "kv_heads": 2}, "no grouped-query attention"),
        ("gpt2", {"dtype": "int8"}, "dtype 'int8'"),
        ("gpt2", {"vocab_size": 100_000}, "the corpus gives at most"),
    ],
)
def test_a_shape_that_cannot_be_built_is_refused_and_leaves_nothing(
    tmp_path: Path, arch: str, dimensions: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_lm(tmp_path / "lm", arch, **dimensions)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_build_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(lm_build, "save_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_small(tmp_path / "lm", "gpt2")
    assert list(tmp_path.iterdir()) == []


def test_the_cli_refuses_a_non_empty_dest_and_replaces_it_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "lm"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    assert main(["models", "build-lm", str(dest), "--arch", "llama"]) == 1
    assert "exists and is not empty (--force replaces it)" in capsys.readouterr().out
    assert [p.name for p in dest.iterdir()] == ["notes.txt"]

    assert main(["models", "build-lm", str(dest), "--arch", "llama", "--seed", "3", "--force"]) == 0
    out = capsys.readouterr().out
    assert {p.name for p in dest.iterdir()} == FILES
    assert [p.name for p in tmp_path.iterdir()] == ["lm"]  # nothing left beside it
    for name in FILES:
        assert f"{(dest / name).stat().st_size:,} bytes  {dest / name}" in out
    assert f"{parameter_count(dest):,} parameters" in out
    config = json.loads((dest / "config.json").read_text())  # the defaults
    assert config["num_hidden_layers"] == lm_build.LAYERS
    assert config["hidden_size"] == lm_build.HIDDEN
    assert config["num_attention_heads"] == lm_build.HEADS
    assert config["vocab_size"] == lm_build.VOCAB_SIZE
    assert config["max_position_embeddings"] == lm_build.CONTEXT_TOKENS
    assert "--seed 3" in (dest / "README.md").read_text()
    AutoModelForCausalLM.from_pretrained(dest)


def test_the_cli_refuses_a_shape_and_an_arch_it_cannot_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = str(tmp_path / "lm")
    assert main(["models", "build-lm", dest, "--arch", "gpt2", "--hidden", "102"]) == 1
    assert "error: hidden 102 is not a multiple of heads 4" in capsys.readouterr().out
    assert main(["models", "build-lm", dest, "--arch", "bert"]) == 2
    assert "invalid choice: 'bert' (choose from 'gpt2', 'llama')" in capsys.readouterr().err
    assert main(["models", "build-lm", dest, "--arch", "gpt2", "--layers", "0"]) == 2
    assert list(tmp_path.iterdir()) == []
