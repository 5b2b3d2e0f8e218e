"""Chat templates: the text a causal LM was trained to read a conversation as.

A Hugging Face model ships its conversation format as a Jinja template, in
tokenizer_config.json (``chat_template``: a string, or a list of named ones
of which ``default`` is used) or in a ``.jinja`` file. The API renders it
once per job, to count the prompt's tokens, and stores the text it made; the
worker runs that text, so both see the same prompt.

Rendering follows transformers' ``apply_chat_template``: a sandboxed
environment with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``,
a ``tojson`` that does not escape HTML, ``strftime_now``, the special tokens
of tokenizer_config.json (``bos_token``, ``eos_token`` ...), ``tools`` and
``documents`` as None, and ``add_generation_prompt``. A template is compiled
once per file per process.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_CONFIG = "tokenizer_config.json"
# What transformers passes a template of the tokenizer's special tokens.
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A template file that cannot be read, holds no template, or does not compile."""


class TemplateRefused(ValueError):
    """The template refused a conversation (its ``raise_exception``, or an error rendering it)."""


def template_source(path: Path) -> str | None:
    """The template ``path`` holds: a ``.jinja`` file's text, or tokenizer_config.json's.

    None: a JSON file without a ``chat_template`` member. Raises
    :class:`ChatTemplateError` for a file that cannot be read as either.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot be read ({exc})") from None
    if path.suffix != ".json":
        return text
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ChatTemplateError(f"is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("chat_template") is None:
        return None
    found = config["chat_template"]
    if isinstance(found, str):
        return found
    if isinstance(found, list):
        named = {
            t.get("name"): t.get("template")
            for t in found
            if isinstance(t, dict) and isinstance(t.get("template"), str)
        }
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise ChatTemplateError("chat_template lists no template named 'default'")
    raise ChatTemplateError("chat_template must be a string or a list of {name, template}")


def special_tokens(folder: Path) -> dict[str, str]:
    """The special tokens tokenizer_config.json in ``folder`` names (none without one)."""
    try:
        config = json.loads((folder / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name) if isinstance(config, dict) else None
        # A token saved as an AddedToken is an object with its text under "content".
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


@dataclass(frozen=True)
class ChatTemplate:
    """One compiled template and the special tokens it is rendered with."""

    source: Path
    template: jinja2.Template
    tokens: Mapping[str, str]

    def render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of ``messages``; raises :class:`TemplateRefused` when it will not."""
        conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
        try:
            return self.template.render(
                messages=conversation,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.tokens,
            )
        except Exception as exc:
            # The template is code run on a client's messages: whatever it raises
            # refuses that conversation, it is not an error of the server.
            raise TemplateRefused(str(exc) or type(exc).__name__) from None


class _Templates:
    """Templates by file, compiled once per process (again only if the file changes)."""

    _lock = threading.Lock()
    # path -> (the file's mtime and size when compiled, the template)
    _loaded: dict[Path, tuple[tuple[int, int], ChatTemplate]] = {}  # noqa: RUF012 (one per process)

    @classmethod
    def get(cls, path: Path) -> ChatTemplate:
        try:
            stat = path.stat()
        except OSError as exc:
            raise ChatTemplateError(f"cannot be read ({exc})") from None
        # The repository is read again at every poll; only a changed file is compiled again.
        signature = (stat.st_mtime_ns, stat.st_size)
        with cls._lock:
            found = cls._loaded.get(path)
            if found is None or found[0] != signature:
                found = (signature, compile_template(path))
                cls._loaded[path] = found
            return found[1]


def load_template(path: Path) -> ChatTemplate:
    """The template of ``path`` (see :func:`template_source`), compiled once per process."""
    return _Templates.get(path)


def compile_template(path: Path) -> ChatTemplate:
    """``path``'s template compiled now; :class:`ChatTemplateError` if it has none or is broken."""
    source = template_source(path)
    if source is None:
        raise ChatTemplateError("has no chat_template")
    try:
        template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"is not a valid template (line {exc.lineno}: {exc})") from None
    return ChatTemplate(path, template, special_tokens(path.parent))


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which no model was trained on.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return dt.datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates without the type itself (no attribute to climb out by)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing the underscore names that reach CPython's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick, so that namespace(self=...) still works.
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a template may not set an underscore name on a namespace ({name!r})"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: rendered as its body.

    transformers marks the assistant's tokens with it for training masks;
    rendering a prompt needs only the text.
    """

    tags = {"generation"}  # noqa: RUF012 (Jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())
