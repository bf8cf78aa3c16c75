"""A tiny random model that reads and writes text: a byte-level tokenizer (every UTF-8 byte a
token) beside tiny.py's model, saved as a Hugging Face folder that the command line and the server
load, tokenize and decode with in a fraction of a second (context 128 tokens by default)."""

from __future__ import annotations

import torch

from tiny import tiny_config

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def byte_tokenizer():
    """A byte-level tokenizer with no merges (every UTF-8 byte a token, ids 3..258, after <pad>,
    <s>, </s>) and a plain chat template: text in, text out, for a tiny model with 259 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(sorted(alphabet))}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_with_tokenizer(folder, arch: str = "llama", num_layers: int = 3, context: int = 128):
    """A tiny random model of `arch` with byte_tokenizer() saved as a Hugging Face folder (a model
    the command line can load, tokenize and decode with in a fraction of a second)."""
    from transformers import AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    config = tiny_config(arch, num_layers)
    config.vocab_size = len(tokenizer)
    config.max_position_embeddings = context
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
