"""core.models.chat renders a chat template to the text transformers' apply_chat_template does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.models.chat import (
    ChatTemplateError,
    TemplateRefused,
    compile_template,
    load_template,
    special_tokens,
    template_source,
)
from tests.causal_lm_files import CHATML, LLAMA2, tokenizer

# Block tags on lines of their own, indented: trim_blocks and lstrip_blocks decide the text.
INDENTED = """\
{% for message in messages %}
    {% if message['role'] == 'system' %}
[SYS] {{ message['content'] }}
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a story."},
    ],
    [
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat on the mat"},
        {
            "role": "user",
            "content": "  and then?\n\nTwo lines, {{ braces }} and <tags> & quotes \" '",
        },
    ],
    [{"role": "user", "content": "Ünïcödé ✓ 日本語"}],
]


def saved_by_transformers(folder: Path, chat_template: str) -> Any:
    """A tokenizer folder written by transformers itself, and the tokenizer read back from it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=chat_template,
    ).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def template_file(folder: Path) -> Path:
    """Where transformers put the template: a .jinja file, or tokenizer_config.json's member."""
    jinja = folder / "chat_template.jinja"
    return jinja if jinja.is_file() else folder / "tokenizer_config.json"


@pytest.mark.parametrize(
    "template", [CHATML, LLAMA2, INDENTED], ids=["chatml", "llama2", "indented"]
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(
    tmp_path: Path, template: str, add_generation_prompt: bool
) -> None:
    hf = saved_by_transformers(tmp_path, template)
    ours = load_template(template_file(tmp_path))
    for conversation in CONVERSATIONS:
        if template is LLAMA2 and conversation[-1]["role"] != "user":
            continue
        expected = hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.render(conversation, add_generation_prompt) == expected
    # The conversation's roles are in the text: the template really ran on them.
    assert "Tell me a story." in ours.render(CONVERSATIONS[1])


def test_the_same_template_from_tokenizer_config_json(tmp_path: Path) -> None:
    hf = saved_by_transformers(tmp_path / "hf", CHATML)
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_template(tmp_path / "tokenizer_config.json")
    for conversation in CONVERSATIONS:
        expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ours.render(conversation) == expected
    assert (
        ours.render(CONVERSATIONS[0])
        == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_raises_refuses_as_transformers_does(tmp_path: Path) -> None:
    hf = saved_by_transformers(tmp_path, LLAMA2)
    ours = load_template(template_file(tmp_path))
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="roles must alternate"):
        hf.apply_chat_template(twice, tokenize=False)
    with pytest.raises(TemplateRefused, match="roles must alternate"):
        ours.render(twice)


def test_bos_and_eos_come_from_tokenizer_config(tmp_path: Path) -> None:
    config = {"bos_token": {"content": "<B>", "__type": "AddedToken"}, "eos_token": "<E>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "t.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    assert special_tokens(tmp_path) == {"bos_token": "<B>", "eos_token": "<E>"}
    assert compile_template(tmp_path / "t.jinja").render([{"role": "user", "content": "x"}]) == (
        "<B>x<E>"
    )


def test_named_templates_use_default(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer_config.json"
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    path.write_text(json.dumps({"chat_template": named}))
    assert template_source(path) == "PLAIN"
    path.write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(ChatTemplateError, match="no template named 'default'"):
        template_source(path)
    path.write_text(json.dumps({"bos_token": "<s>"}))
    assert template_source(path) is None
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        compile_template(path)


def test_a_broken_template_is_an_error_naming_its_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}\n{{ m['content'] }\n")
    with pytest.raises(ChatTemplateError, match="line 2"):
        compile_template(path)


def test_the_sandbox_holds(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateRefused):
        compile_template(path).render([{"role": "user", "content": "x"}])
    path.write_text("{% set ns = namespace(_x=1) %}{{ ns }}")
    with pytest.raises(TemplateRefused, match="underscore"):
        compile_template(path).render([{"role": "user", "content": "x"}])


def test_tojson_does_not_escape_html_and_generation_blocks_render(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(
        "{{ messages[0]['content'] | tojson }}|{% generation %}{{ messages[0]['role'] }}"
        "{% endgeneration %}"
    )
    rendered = compile_template(path).render([{"role": "user", "content": "<b>&é"}])
    assert rendered == '"<b>&é"|user'


def test_compiled_once_per_file_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("one")
    first = load_template(path)
    assert load_template(path) is first
    path.write_text("two, longer")
    assert load_template(path).render([]) == "two, longer"
