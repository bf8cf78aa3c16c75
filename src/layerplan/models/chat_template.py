"""A model's chat template rendered as transformers renders it (apply_chat_template), without
transformers: a sandboxed jinja2 environment with trimmed blocks, loop controls, its
`{% generation %}` blocks (rendered as their body), its `raise_exception`, `tojson`,
`strftime_now`, `dict` and `namespace`, the named special tokens beside the messages, no tools or
documents. The light front end's chat renders a conversation with it, and the file index finds a
template's frame with it (models/file_index.py chat_frame); tests/test_chat_template.py holds it
to transformers' own rendering.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the special tokens a template sees by name (transformers' SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A chat template that refuses a conversation (its raise_exception) or cannot be compiled."""


class _Generation(Extension):
    """transformers' `{% generation %}…{% endgeneration %}` (it marks the assistant's tokens for a
    training mask): the body, rendered as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, and no more of the type (transformers' TemplateDict)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)`, refusing underscore names (transformers' TemplateNamespace: no way to the
    interpreter's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes on a "
                                                  f"namespace, but got {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # (jinja2's own tojson escapes HTML characters, which a prompt must keep)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class ChatTemplate:
    """A template compiled once; render() gives the text transformers' apply_chat_template(...,
    tokenize=False) gives for the same messages (tokenized without added special tokens, its
    tokenize=True ids). ChatTemplateError where it does not compile."""

    def __init__(self, text: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[_Generation, loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                                   dict=_TemplateDict(), namespace=_Namespace)
        try:
            self._compiled = environment.from_string(text)
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template cannot be compiled: {error}") from None
        self.text = text
        self.special_tokens = {name: value for name, value in (special_tokens or {}).items() if value is not None}

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation's text, the assistant's turn opened after it (add_generation_prompt)."""
        try:
            return self._compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template refuses these messages: {error}") from None


def special_tokens_of(tokenizer_config: Mapping) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json (a string, or an AddedToken's
    {"content": …}), as transformers hands them to a template."""
    found = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        value = value.get("content") if isinstance(value, Mapping) else value
        if isinstance(value, str):
            found[name] = value
    return found


# where a reply in 'role: content' lines ends: a base model given them goes on to write the user's
# next turn itself, which is no part of its reply
PLAIN_CHAT_STOPS = ("\nuser:",)


def plain_chat_text(messages: Sequence[Mapping[str, str]]) -> str:
    """A conversation for a model without a chat template: 'role: content' lines, then the
    assistant's turn opened (its ids: the text with the tokenizer's added special tokens)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
