"""models/chat_template.py renders a chat template as transformers' apply_chat_template does: the
packaged SmolLM2's template and templates that use what real ones use (a namespace, loop
controls, raise_exception, tojson, `{% generation %}`, the special tokens by name, the date),
for conversations with system messages, several turns, braces and non-ASCII text."""

from __future__ import annotations

import pytest

from layerplan.models.chat_template import ChatTemplate, ChatTemplateError, plain_chat_text, special_tokens_of

ALTERNATING = (  # llama-2 / Mistral style: raise_exception where the roles do not alternate
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
NAMESPACED = (  # Qwen / Llama 3 style: a namespace carried across the loop, loop.last, tojson, tools
    "{%- set ns = namespace(system='', turns=0) -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message.role == 'system' -%}{%- set ns.system = message.content -%}{%- continue -%}{%- endif -%}\n"
    "  {%- set ns.turns = ns.turns + 1 -%}\n"
    "<|start|>{{ message.role }}{% if loop.last %} (last){% endif %}\n{{ message.content | trim }}<|end|>\n"
    "{%- endfor -%}\n"
    "{% if ns.system %}<|system|>{{ ns.system | tojson }}{% endif %}"
    "{% if tools is not none %}{{ tools | tojson }}{% endif %}"
    "{{ dict(turns=ns.turns) | tojson }} {{ strftime_now('%Y') }}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
GENERATION = (  # a template that marks the assistant's tokens for training masks
    "{% for message in messages %}{{ message.role }}: "
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}"
    "{% else %}{{ message.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  two\n lines  "}],
    [{"role": "user", "content": "{{ not a template }} {% raw %}"}, {"role": "assistant", "content": "é ü 你好"},
     {"role": "user", "content": "<|im_end|> and \"quotes\""}],
]


def _transformers_tokenizer(template: str):
    from tiny_text import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def _smollm2_template() -> str:
    from layerplan.models.gguf_index import file_index
    from layerplan.models.gguf_place import gguf_of

    return (file_index(gguf_of("smollm2")) / "chat_template.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["smollm2", "alternating", "namespaced", "generation", "plain lines"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "system", "turns"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_template_renders_as_transformers_renders_it(name, conversation, add_generation_prompt):
    from tiny_text import CHAT_TEMPLATE

    template = {"smollm2": _smollm2_template, "alternating": lambda: ALTERNATING, "namespaced": lambda: NAMESPACED,
                "generation": lambda: GENERATION, "plain lines": lambda: CHAT_TEMPLATE}[name]()
    tokenizer = _transformers_tokenizer(template)
    ours = ChatTemplate(template, tokenizer.special_tokens_map)
    try:
        theirs = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                               tokenize=False)
    except Exception as error:  # noqa: BLE001 - the template refused: ours refuses too, in one line
        assert name == "alternating", error
        with pytest.raises(ChatTemplateError, match="roles must alternate"):
            ours.render(conversation, add_generation_prompt)
        return
    assert ours.render(conversation, add_generation_prompt) == theirs


def test_a_template_that_does_not_compile_is_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="cannot be compiled"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


def test_a_namespace_refuses_underscore_names_as_transformers_does():
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns._x }}").render([{"role": "user", "content": "x"}])


def test_special_tokens_come_by_name_from_a_tokenizer_config():
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": None,
              "chat_template": "ignored", "model_max_length": 8}
    assert special_tokens_of(config) == {"bos_token": "<s>", "eos_token": "</s>"}


def test_a_model_without_a_template_gets_role_lines():
    assert plain_chat_text(CONVERSATIONS[1]) == "system: Be brief.\nuser:   two\n lines  \nassistant:"
