"""A causal LM's files as the API reads them, small enough to write in a test.

A word-level tokenizer.json (every word or run of punctuation is one token,
unknown words included, so counts are easy to predict; the post-processor
puts ``<s>`` in front, as Llama's does), a tokenizer_config.json with the
special tokens and, where asked, a ``chat_template``, and a config.json
giving the context length. No weights: nothing here runs a model.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from core.models.catalog import ModelSpec, input_spec
from core.models.repository import ModelConfig

SPECIAL = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "hello", "world", "the", "cat", "sat", "on", "mat"]

# ChatML, as Qwen and SmolLM write it.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 2's shape: the BOS token from the config, a system prompt folded into
# the first user turn, and raise_exception when the roles do not alternate.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


def tokenizer() -> Any:
    """The word-level ``tokenizers.Tokenizer`` the files hold."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    built = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    built.pre_tokenizer = pre_tokenizers.Whitespace()
    built.add_special_tokens(SPECIAL)
    built.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    return built


def write_version(
    files: Path,
    chat_template: str | list[dict[str, str]] | None = CHATML,
    context_tokens: int | None = 64,
    context_key: str = "max_position_embeddings",
) -> Path:
    """tokenizer.json, tokenizer_config.json and config.json in ``files`` (made if needed)."""
    files.mkdir(parents=True, exist_ok=True)
    tokenizer().save(str(files / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (files / "tokenizer_config.json").write_text(json.dumps(config))
    model: dict[str, Any] = {"model_type": "llama", "vocab_size": len(SPECIAL) + len(WORDS)}
    if context_tokens is not None:
        model[context_key] = context_tokens
    (files / "config.json").write_text(json.dumps(model))
    return files


def write_model(root: Path, name: str = "tiny-lm", input_table: str = "", **version: Any) -> Path:
    """A generation model's folder under ``root``: model.toml and version 1's files."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.toml").write_text(
        f'name = "{name}"\nbackend = "causal-lm"\n'
        '[input]\nkind = "generation"\ntokenizer = "tokenizer.json"\n'
        f"{textwrap.dedent(input_table)}\n"
        '[cost]\nfunction = "tokens"\n'
    )
    write_version(folder / "1", **version)
    return folder


def catalog_spec(model: ModelConfig) -> ModelSpec:
    """The API's spec of a generation model, as backends.catalog builds one.

    Tests put it in an app's catalog: the API describes and checks a
    generation model without its backend.
    """
    return ModelSpec(
        name=model.name,
        description=model.description,
        backend=model.backend,
        active_version=model.active_version,
        versions=tuple(sorted(model.versions)),
        max_batch_size=8,
        input=input_spec(model),
    )
