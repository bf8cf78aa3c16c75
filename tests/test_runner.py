"""The plan loop against transformers' own logits, on tiny models of every architecture."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerplan.engine.runner import Resume, forward, head, new_cache, run_hidden
from layerplan.export import export_checkpoint
from layerplan.models.loading import wrap_model
from layerplan.engine.verify import incremental_logits as incremental  # prefill 6, a 3-token chunk, then 1 by 1
from layerplan.plan.plan import parse_plan
from tiny import ARCHS, VOCAB, tiny_model

TOL = 1e-4


def ids_for(seed=0, length=14):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=g)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_identity_plan_equals_transformers(arch, attn):
    model = tiny_model(arch, attn=attn)
    ids = ids_for()  # 14 tokens: longer than the sliding windows (4, 5) of the configs
    with torch.no_grad():
        reference = model.hf(ids).logits
    assert (forward(model, ids) - reference).abs().max() < TOL
    assert (incremental(model, ids, model.plan()) - reference).abs().max() < TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_equals_transformers(arch):
    model = tiny_model(arch)
    ids = torch.cat([ids_for(1), ids_for(2)])
    with torch.no_grad():
        reference = model.hf(ids).logits
    assert (forward(model, ids) - reference).abs().max() < TOL


def _reload(folder, attn="sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gpt2"])
def test_exit_after_k_equals_truncated_checkpoint(arch, tmp_path):
    model = tiny_model(arch, num_layers=4)
    ids = ids_for(3)
    k = 2
    truncated = _reload(export_checkpoint(model, parse_plan("0-1", 4), tmp_path / "truncated"))
    assert truncated.config.num_hidden_layers == k
    with torch.no_grad():
        reference = truncated(ids).logits
    plan = parse_plan(f"exit:{k}", 4)
    assert (forward(model, ids, plan) - reference).abs().max() < TOL
    assert (incremental(model, ids, plan) - reference).abs().max() < TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3", "gpt2"])
def test_repeat_gets_own_slot_equals_duplicated_checkpoint(arch, tmp_path):
    model = tiny_model(arch, num_layers=3)
    plan = parse_plan("0,1,1,2", 3)
    duplicated = _reload(export_checkpoint(model, plan, tmp_path / "dup"))
    assert duplicated.config.num_hidden_layers == 4
    ids = ids_for(4)
    with torch.no_grad():
        reference = duplicated(ids).logits
    assert (forward(model, ids, plan) - reference).abs().max() < TOL
    assert (incremental(model, ids, plan) - reference).abs().max() < TOL
    # sanity: the duplicate is a different model from the original
    assert (forward(model, ids) - reference).abs().max() > 1e-3


def test_shared_slot_would_be_wrong():
    """Two steps of the same layer writing one slot is a different model: guard the invariant."""
    model = tiny_model("llama")
    plan = parse_plan("0,1,1,2", 3)
    cache = new_cache(plan)
    assert cache.num_slots == 4
    ids = ids_for(5)
    forward(model, ids, plan, cache)
    assert not torch.equal(cache.keys[1][:, :, :14], cache.keys[2][:, :, :14])


def test_sublayer_skip_and_scale_match_manual_layer_math():
    model = tiny_model("llama", num_layers=2)
    ids = ids_for(6)
    layer0 = model.hf.model.layers[0]
    with torch.no_grad():
        h = model.hf.model.embed_tokens(ids)
        cos_sin = model.hf.model.rotary_emb(h, torch.arange(ids.shape[1])[None])
        # layer 0: attention off, MLP at half scale; layer 1: full
        h = h + 0.5 * layer0.mlp(layer0.post_attention_layernorm(h))
        h = model.hf.model.layers[1](h, position_embeddings=cos_sin, attention_mask=None)
        expected = model.hf.lm_head(model.hf.model.norm(h))
    plan = parse_plan("0/mlp@0.5,1", 2)
    assert (forward(model, ids, plan) - expected).abs().max() < TOL


def test_resume_from_captured_stream_equals_full_run():
    model = tiny_model("qwen3", num_layers=4)
    ids = ids_for(7)
    plan = model.plan()
    captured = {}
    full = head(model, run_hidden(model, ids, plan, observe=lambda i, sub, h: captured.__setitem__((i, sub), h)))
    assert len(captured) == 8
    for (step, sub), hidden in captured.items():
        resumed = head(model, run_hidden(model, None, plan, resume=Resume(hidden, step, sub)))
        assert torch.equal(resumed, full)


def test_rollback_then_rewrite_equals_fresh_run():
    model = tiny_model("mistral")
    ids = ids_for(8)
    plan = model.plan()
    cache = new_cache(plan)
    forward(model, ids[:, :8], plan, cache, 0)
    forward(model, torch.tensor([[5, 6, 7]]), plan, cache, 8)  # a rejected draft
    cache.crop(8)
    assert cache.length == 8
    logits = forward(model, ids[:, 8:], plan, cache, 8)
    with torch.no_grad():
        reference = model.hf(ids).logits[:, 8:]
    assert (logits - reference).abs().max() < TOL


def test_writing_past_a_hole_is_refused():
    model = tiny_model("llama")
    plan = model.plan()
    cache = new_cache(plan)
    forward(model, ids_for()[:, :4], plan, cache, 0)
    with pytest.raises(RuntimeError, match="KV slot 0 holds 4 positions but a write starts at 6"):
        forward(model, ids_for()[:, :1], plan, cache, 6)


def test_wrap_model_and_unsupported_architecture():
    from transformers import BertConfig, BertLMHeadModel

    from layerplan.models.loading import ModelError

    bert = BertLMHeadModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, is_decoder=True))
    with pytest.raises(ModelError, match="architecture 'bert' is refused: an encoder .* not a decoder-only causal LM"):
        wrap_model(bert)


@pytest.mark.real
def test_real_model_identity_plan_equals_transformers(smollm2):
    ids = smollm2.encode("The quick brown fox jumps over the lazy dog. def f(x): return x * 2")
    with torch.no_grad():
        reference = smollm2.hf(ids).logits
    assert (forward(smollm2, ids) - reference).abs().max() < TOL
    assert (incremental(smollm2, ids, smollm2.plan(), splits=(5, 8)) - reference).abs().max() < TOL
