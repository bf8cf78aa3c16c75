"""The torch front end's model of a GGUF made from the file (engine/file_model.py): the logits of
the model transformers' modules make, the same rotary tables and layer facts, and transformers'
modules built only where something asks for them."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_hf
from tiny_gguf import write_tiny_gguf

from layerplan.engine.executors import use_modules
from layerplan.engine.file_model import DeferredCausalLM, FileRotary
from layerplan.engine.choices import STORED_ARITHMETIC
from layerplan.engine.load import load_model, prepare
from layerplan.engine.runner import forward, new_cache
from layerplan.models.loading import load_stored_model

PROMPT = [5, 17, 3, 88, 41, 9, 60]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))


def _qwen3():
    """A tiny Qwen3 of head_dim 128: the head_dim transformers' GGUF reader gives every Qwen3 file
    (it reads no key length), so that its modules can be built for it."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config).eval()


def _models(tmp_path, arch: str, matrix_type: str, dtype: str):
    """(the GGUF's model made from the file, the same file's model made from transformers'
    modules), both on the native engine."""
    # six Gemma 3 layers: the sixth full attention, the rest sliding (its rotary tables by layer type)
    hf = _qwen3() if arch == "qwen3" else tiny_hf(arch, num_layers=6 if arch == "gemma3" else 3)
    path = write_tiny_gguf(hf, tmp_path / f"{arch}.gguf", matrix_type)
    from_file = load_model(path, dtype=dtype, engine="native")
    from_modules = prepare(load_stored_model(path, STORED_ARITHMETIC[dtype]), "native", pack=False)
    assert isinstance(from_file.hf, DeferredCausalLM) and not isinstance(from_modules.hf, DeferredCausalLM)
    assert from_file.native.file is not None and from_modules.native.file is not None
    return from_file, from_modules


@pytest.mark.parametrize("arch,matrix_type", [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("qwen3", "Q8_0"),
                                              ("gemma3", "Q8_0")])
@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_the_file_model_gives_the_modules_models_logits(tmp_path, arch, matrix_type, dtype):
    """Every plan's prompt pass (every row) and the decoding steps after it: the same bits; and no
    transformers module was built for it."""
    from_file, from_modules = _models(tmp_path, arch, matrix_type, dtype)
    for text in (None, "0,1,1,2", "exit:2", "skip:attn=1;mlp=0"):
        plan = from_file.plan(text)
        caches = new_cache(plan, 64), new_cache(plan, 64)
        got, want = (forward(model, torch.tensor([PROMPT]), plan, cache) for model, cache in zip(
            (from_file, from_modules), caches))
        assert torch.equal(got, want), text
        for i, token in enumerate((7, 80, 2)):
            position = len(PROMPT) + i
            got, want = (forward(model, torch.tensor([[token]]), plan, cache, position, last_only=True)
                         for model, cache in zip((from_file, from_modules), caches))
            assert torch.equal(got, want), (text, i)
    assert from_file.hf._skeleton is None  # (its passes needed none of transformers' modules)
    assert from_file.eos_token_ids == from_modules.eos_token_ids
    assert from_file.context_length == from_modules.context_length and from_file.dtype == from_modules.dtype


def test_the_file_models_layer_facts_and_rotary_tables_are_the_modules(tmp_path):
    """Each layer's attention type and window, and the rotary module's (cos, sin) at every
    position for each layer type, are those of the model transformers builds."""
    from_file, from_modules = _models(tmp_path, "gemma3", "Q8_0", "stored")
    assert isinstance(from_file.parts.rotary, FileRotary)
    assert from_file.parts.layer_types == from_modules.parts.layer_types == ("full_attention", "sliding_attention")
    for mine, theirs in zip(from_file.parts.layers, from_modules.parts.layers, strict=True):
        assert (mine.layer_type, mine.sliding_window, mine.parallel) == (
            theirs.layer_type, theirs.sliding_window, theirs.parallel)
    positions = torch.arange(0, 300)[None]
    like = torch.zeros(1, dtype=torch.float32)
    for layer_type in from_file.parts.layer_types:
        for got, want in zip(from_file.parts.rotary(like, positions, layer_type),
                             from_modules.parts.rotary(like, positions, layer_type), strict=True):
            assert torch.equal(got, want), layer_type


def test_the_file_models_modules_are_built_when_asked_for(tmp_path):
    """A layer's module, asked for, is transformers' (the skeleton built once, its stored
    matrices known to the model's StoredWeights): the eager engine runs them, and gives the
    kernels' logits within float rounding."""
    from_file, _ = _models(tmp_path, "llama", "Q8_0", "stored")
    ids = torch.tensor([PROMPT])
    native = forward(from_file, ids)
    attention = from_file.parts.layers[1].attention
    assert type(attention).__name__ == "LlamaAttention" and from_file.hf._skeleton is not None
    assert from_file.parts.layers[1].attention is attention  # built once
    assert from_file.stored.of(attention.q_proj) is not None
    use_modules(from_file)  # every sub-layer on its module, its stored matrices dequantized a layer at a time
    assert torch.allclose(forward(from_file, ids), native, atol=1e-4)
