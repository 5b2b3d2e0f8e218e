"""Small causal language models, built here: seeded random weights and a trained tokenizer.

No causal LM can be downloaded where Ferry is developed and tested, and none ships in a
package, so ``build_lm`` writes one: a Hugging Face model folder (``config.json``,
``model.safetensors``, ``generation_config.json``, the tokenizer's files and a README) that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load like any
other. Its weights are random, so its text is noise; its shapes, tokenizer, special tokens and
chat template are those of a real model, and a real model's folder can take its place.

Two shapes: ``gpt2`` (learned positions, LayerNorm, GELU MLP, tied embeddings, one
``<|endoftext|>`` token) and ``llama`` (grouped-query attention, rotary positions, RMSNorm,
SiLU gated MLP, untied embeddings, ``<s>`` and ``</s>`` plus ChatML's chat tokens and template).

The tokenizer is a byte-level BPE trained on ``ferry/data/lm_corpus.txt`` (Ferry's own
documentation, frozen when it was written), so every byte string encodes and decodes back. The
same arguments give byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ARCHES = ("gpt2", "llama")
DTYPES = ("float32", "bfloat16", "float16")
CORPUS = "lm_corpus.txt"
# A pair of tokens seen once in the corpus is not merged: the vocabulary holds what repeats.
MIN_PAIR_FREQUENCY = 2

# The defaults: loaded in tens of milliseconds, a 256-token forward in a few on one CPU core.
LAYERS = 4
HIDDEN = 128
HEADS = 4
VOCAB_SIZE = 2048
CONTEXT_TOKENS = 2048

GPT2_END = "<|endoftext|>"
LLAMA_SPECIALS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """A model's dimensions, every one explicit (the README's rebuild command lists them)."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int
    context_tokens: int
    dtype: str

    def flags(self) -> str:
        return (
            f"--arch {self.arch} --layers {self.layers} --hidden {self.hidden} "
            f"--heads {self.heads} --kv-heads {self.kv_heads} "
            f"--intermediate {self.intermediate} --vocab-size {self.vocab_size} "
            f"--context-tokens {self.context_tokens} --dtype {self.dtype}"
        )


def shape_for(
    arch: str,
    *,
    layers: int = LAYERS,
    hidden: int = HIDDEN,
    heads: int = HEADS,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab_size: int = VOCAB_SIZE,
    context_tokens: int = CONTEXT_TOKENS,
    dtype: str = "float32",
) -> Shape:
    """The dimensions, with each arch's defaults filled in; ValueError names a bad one."""
    if arch not in ARCHES:
        raise ValueError(f"arch {arch!r}: one of {', '.join(ARCHES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if min(layers, hidden, heads, vocab_size, context_tokens) < 1:
        raise ValueError("layers, hidden, heads, vocab_size and context_tokens are at least 1")
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    if arch == "gpt2":
        if kv_heads not in (None, heads):
            raise ValueError("gpt2 has no grouped-query attention: kv_heads equals heads")
        kv_heads = heads
        intermediate = intermediate or 4 * hidden
    else:
        # Grouped-query attention: two query heads share each key/value head by default.
        kv_heads = kv_heads or max(1, heads // 2)
        # Llama's 8/3 of hidden for the gated MLP, rounded up to a multiple of 64.
        intermediate = intermediate or -(-(8 * hidden // 3) // 64) * 64
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    return Shape(
        arch, layers, hidden, heads, kv_heads, intermediate, vocab_size, context_tokens, dtype
    )


class Dimensions(TypedDict, total=False):
    """``shape_for``'s keywords, each optional: a model's dimensions."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int | None
    intermediate: int | None
    vocab_size: int
    context_tokens: int
    dtype: str


def build_lm(
    dest: Path, arch: str, *, seed: int = 0, force: bool = False, **dimensions: Unpack[Dimensions]
) -> Path:
    """Write a model folder of ``arch`` at ``dest`` and return it; see ``build_shape``."""
    return build_shape(dest, shape_for(arch, **dimensions), seed=seed, force=force)


def build_shape(dest: Path, shape: Shape, *, seed: int = 0, force: bool = False) -> Path:
    """Write a model folder at ``dest`` and return it.

    ``dest`` must be missing or empty unless ``force``. The folder is written beside ``dest``
    and renamed into place at the end, so an interrupted build leaves no folder at ``dest``.
    """
    dest = Path(dest)
    if not force and dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} exists and is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        os.chmod(staging, 0o755)
        write_model(staging, shape, seed)
        _swap_in(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def _swap_in(staging: Path, dest: Path) -> None:
    """Rename ``staging`` to ``dest``, moving what was there aside first and then deleting it."""
    if not dest.exists():
        staging.rename(dest)
        return
    aside = dest.with_name(f"{staging.name}.old")
    dest.rename(aside)
    staging.rename(dest)
    if aside.is_dir():
        shutil.rmtree(aside)
    else:
        aside.unlink()


def write_model(folder: Path, shape: Shape, seed: int) -> None:
    """The model's files into an existing folder."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = train_tokenizer(shape.arch, shape.vocab_size)
    trained = tokenizer.get_vocab_size()
    if trained != shape.vocab_size:
        raise ValueError(
            f"vocab_size {shape.vocab_size}: the corpus gives at most {trained} tokens"
        )
    ids = special_ids(shape.arch, tokenizer)
    config = model_config(shape, ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, shape.dtype))
    eos: int | list[int] = ids["eos"]
    if shape.arch == "llama":  # a chat turn ends at <|im_end|>, plain text at </s>
        eos = [ids["eos"], ids["im_end"]]
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=eos, pad_token_id=ids["pad"]
    )
    model.save_pretrained(folder)
    save_tokenizer(folder, shape, tokenizer)
    (folder / "README.md").write_text(readme(shape, seed))


def corpus_text() -> str:
    return (resources.files("ferry") / "data" / CORPUS).read_text(encoding="utf-8")


def train_tokenizer(arch: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the shipped corpus, with the arch's special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [GPT2_END] if arch == "gpt2" else list(LLAMA_SPECIALS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_PAIR_FREQUENCY,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    if arch == "llama":  # Llama's tokenizer starts every text with <s>; GPT-2's adds nothing
        bos = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def special_ids(arch: str, tokenizer: Tokenizer) -> dict[str, int]:
    def id_of(token: str) -> int:
        found = tokenizer.token_to_id(token)
        assert found is not None, token
        return found

    if arch == "gpt2":  # GPT-2 has one special token: it begins, ends and pads
        end = id_of(GPT2_END)
        return {"bos": end, "eos": end, "pad": end}
    return {
        "bos": id_of("<s>"),
        "eos": id_of("</s>"),
        "pad": id_of("<pad>"),
        "im_end": id_of("<|im_end|>"),
    }


def special_tokens(arch: str) -> dict[str, str]:
    if arch == "gpt2":
        return {"bos_token": GPT2_END, "eos_token": GPT2_END, "pad_token": GPT2_END}
    return {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def model_config(shape: Shape, ids: dict[str, int]) -> Any:
    from transformers import GPT2Config, LlamaConfig

    if shape.arch == "gpt2":
        return GPT2Config(
            vocab_size=shape.vocab_size,
            n_positions=shape.context_tokens,
            n_embd=shape.hidden,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_inner=shape.intermediate,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
        )
    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context_tokens,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )


def save_tokenizer(folder: Path, shape: Shape, tokenizer: Tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    specials = special_tokens(shape.arch)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        model_max_length=shape.context_tokens,
        clean_up_tokenization_spaces=False,  # decode gives back the very text encoded
        **specials,
    )
    extra = [t for t in LLAMA_SPECIALS if t.startswith("<|")] if shape.arch == "llama" else []
    if extra:
        fast.add_special_tokens({"additional_special_tokens": extra})
        fast.chat_template = CHATML_TEMPLATE
    # In tokenizer_config.json, where every transformers version reads a chat template.
    fast.save_pretrained(folder, save_jinja_files=False)
    # transformers 5 no longer writes special_tokens_map.json; older readers still look there.
    mapping: dict[str, Any] = dict(specials)
    if extra:
        mapping["additional_special_tokens"] = extra
    text = json.dumps(mapping, indent=2, sort_keys=True) + "\n"
    (folder / "special_tokens_map.json").write_text(text)


def readme(shape: Shape, seed: int) -> str:
    chat = (
        "Its tokenizer has a ChatML chat template (`<|im_start|>role ... <|im_end|>`).\n\n"
        if shape.arch == "llama"
        else ""
    )
    return (
        f"# A {shape.arch}-shaped causal language model with random weights\n\n"
        "The weights of this model are random (seeded): the text it generates is noise. It "
        "exists so that Ferry's generation path, tests and benchmarks load, tokenize and run "
        "a real Hugging Face model folder where no trained model can be downloaded.\n\n"
        f"{shape.layers} layers, hidden size {shape.hidden}, {shape.heads} attention heads "
        f"({shape.kv_heads} key/value heads), MLP size {shape.intermediate}, "
        f"{shape.vocab_size} tokens, context of {shape.context_tokens} tokens, {shape.dtype}, "
        f"seed {seed}. Its byte-level BPE tokenizer was trained on Ferry's documentation.\n\n"
        f"{chat}"
        "Rebuilt, byte for byte, into a folder DEST by:\n\n"
        f"    ferry models build-lm DEST {shape.flags()} --seed {seed}\n\n"
        "A real model's Hugging Face folder (config.json, model.safetensors, the tokenizer's "
        "files) can be put in its place.\n"
    )


def parameter_count(folder: Path) -> int:
    """The parameters in a folder's ``model.safetensors``, read from its header alone."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
            count = 1
            for size in weights.get_slice(name).get_shape():
                count *= size
            total += count
    return total
