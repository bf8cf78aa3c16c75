"""Tiny randomly initialised models of every supported architecture (2–4 layers, hidden 32–64)."""

from __future__ import annotations

import torch

from layerplan.models.arch_table import REFERENCE_ARCHITECTURES
from layerplan.models.loading import LoadedModel, wrap_model

VOCAB = 96


def tiny_config(arch: str, num_layers: int = 3):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.15, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=5)
    if arch == "qwen2":
        # sliding window on the layers from max_window_layers on: mixed layer types
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch in ("gemma3", "gemma3_text"):
        types = ["sliding_attention", "full_attention"] * num_layers
        return tf.Gemma3TextConfig(**common, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                                   layer_types=types[:num_layers], final_logit_softcapping=30.0)
    if arch == "phi3":
        return tf.Phi3Config(**common)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=num_layers, n_head=4, n_positions=128,
                             initializer_range=0.15, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    raise KeyError(arch)


ARCHS = REFERENCE_ARCHITECTURES  # model types; tiny_config also takes "gemma3" for gemma3_text


def tiny_hf(arch: str, num_layers: int = 3, seed: int = 0, dtype=torch.float32, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, num_layers)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def tiny_model(arch: str, num_layers: int = 3, seed: int = 0, dtype=torch.float32, attn: str = "sdpa") -> LoadedModel:
    return wrap_model(tiny_hf(arch, num_layers, seed, dtype, attn), name=f"tiny-{arch}")
