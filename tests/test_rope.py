"""Rotary embeddings by table (engine/rope.py) against the model's own rotary module."""

from __future__ import annotations

import copy

import pytest
import torch

from layerplan.engine import rope
from tiny import tiny_config, tiny_model

ROPE_ARCHS = ("llama", "qwen3", "gemma3", "phi3")


def _module_call(parts, like, positions, layer_type):
    with torch.inference_mode():
        return parts.rotary(like, positions, layer_type) if layer_type else parts.rotary(like, positions)


def _layer_types(parts):
    return sorted({layer.layer_type for layer in parts.layers}) if parts.rope_per_layer_type else [None]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.float().view(torch.int32).long() - b.float().view(torch.int32).long()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_the_table_gives_what_the_module_gives(arch, dtype):
    """In bf16 the same values; in fp32 within a unit in the last place (engine/rope_tables.py
    computes the cosine and sine in float64, the module in float32)."""
    parts = tiny_model(arch, dtype=dtype).parts
    like = torch.zeros(1, 1, parts.lm_head.in_features, dtype=dtype)
    for layer_type in _layer_types(parts):
        assert rope.takes_table(parts.rotary, layer_type)
        # from the start, mid-table, across the table's growth (256 first), far beyond it
        for start, length in [(0, 2), (6, 8), (250, 16), (700, 4)]:
            positions = torch.arange(start, start + length)[None]
            got = rope.rotary_embedding(parts.rotary, like, positions, layer_type)
            chain = rope.chain_rotary_embedding(parts.rotary, like, start, length, layer_type)
            want = _module_call(parts, like, positions, layer_type)
            for g, c, w in zip(got, chain, want):
                assert g.shape == c.shape == w.shape and g.dtype == c.dtype == w.dtype
                assert torch.equal(g, c), (layer_type, start, length)
                if dtype == torch.bfloat16:
                    assert torch.equal(g, w), (layer_type, start, length)
                else:
                    assert _ulps(g, w) <= 1, (layer_type, start, length)


def test_a_positions_values_do_not_depend_on_how_the_table_grew():
    parts = tiny_model("llama").parts
    like = torch.zeros(1, 1, 32)
    grown, at_once = copy.deepcopy(parts.rotary), copy.deepcopy(parts.rotary)
    for end in (1, 9, 300, 1000):  # grown in steps
        rope.rotary_embedding(grown, like, torch.arange(end - 1, end)[None])
    positions = torch.arange(0, 1000)[None]
    for a, b in zip(rope.rotary_embedding(grown, like, positions), rope.rotary_embedding(at_once, like, positions)):
        assert torch.equal(a, b)


class _ThreadedProduct(torch.nn.Module):
    """A rotary module whose many-position calls round positions 32 on differently, as a BLAS
    library's product did when it split a call between two threads."""

    rope_type = "default"

    def forward(self, like, positions):
        angles = positions[..., None].float() * torch.tensor([1.0, 0.01])
        if positions.shape[-1] > 32:
            angles[:, 32:] = torch.nextafter(angles[:, 32:], torch.tensor(float("inf")))
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def test_a_positions_values_are_those_of_the_module_called_on_it_alone():
    module, like = _ThreadedProduct(), torch.zeros(1)
    cos, sin = rope.chain_rotary_embedding(module, like, 0, 300)
    for position in (0, 31, 32, 63, 64, 255, 299):
        want_cos, want_sin = module(like, torch.tensor([[position]]))
        assert torch.equal(cos[0, position], want_cos[0, 0]) and torch.equal(sin[0, position], want_sin[0, 0])


def test_tree_positions_are_looked_up_one_by_one():
    parts = tiny_model("llama").parts
    like = torch.zeros(1, 1, 32)
    depths = torch.tensor([[40, 41, 41, 42, 42, 42]])  # a token tree's positions by depth
    tree = rope.rotary_embedding(parts.rotary, like, depths)
    for i, position in enumerate(depths[0].tolist()):
        chain = rope.chain_rotary_embedding(parts.rotary, like, position, 1)
        assert torch.equal(tree[0][:, i], chain[0][:, 0]) and torch.equal(tree[1][:, i], chain[1][:, 0])


def test_rope_whose_frequencies_change_calls_the_module():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    rotary = LlamaRotaryEmbedding(config)
    assert not rope.takes_table(rotary, None)
    like = torch.zeros(1, 1, 32)
    positions = torch.arange(200, 204)[None]  # beyond max_position_embeddings (128): frequencies rescaled
    got = rope.rotary_embedding(rotary, like, positions)
    chain = rope.chain_rotary_embedding(rotary, like, 200, 4)
    want = LlamaRotaryEmbedding(config)(like, positions)
    assert all(torch.equal(g, w) and torch.equal(c, w) for g, c, w in zip(got, chain, want))
    assert rotary not in rope._tables


def test_a_module_whose_layout_is_its_own_fills_its_table_itself():
    """Cohere interleaves the halves of its rotary rows: rope_tables.py's rows (each half twice)
    are not its values, so its table is its own output, position by position."""
    from transformers import CohereConfig
    from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding

    rotary = CohereRotaryEmbedding(CohereConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128))
    like = torch.zeros(1, 1, 64)
    assert rope.takes_table(rotary, None) and rope._own_frequencies(rotary, None) is None
    positions = torch.arange(0, 40)[None]
    with torch.inference_mode():
        want = [torch.cat([rotary(like, torch.tensor([[p]]))[i] for p in range(40)], 1) for i in range(2)]
    for got, expected in zip(rope.rotary_embedding(rotary, like, positions), want):
        assert torch.equal(got, expected)
