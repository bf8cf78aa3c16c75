"""Dynamic per-token early exit (lossy plain generation, lossless as a draft) and the
reduced-vocabulary draft head."""

import numpy as np
import pytest
import torch
from tiny import tiny_model

from layerplan.decoding.drafters.dynamic_exit import DynamicExit, DynamicExitDrafter, ExitPolicy
from layerplan.decoding.drafters.heads import ReducedHead, frequent_tokens
from layerplan.decoding.drafters.plan import PlanDrafter
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.generate import generate
from layerplan.engine.runner import ModelPasses, head, new_cache, run_hidden

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 11]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_a_policy_that_never_fires_is_the_full_model(arch):
    model = tiny_model(arch, num_layers=4)
    plain = generate(model, PROMPT, max_new_tokens=12)
    for policy in ("confidence=1.0,min=1", "entropy=-1,min=1", "cosine=2,min=1"):
        result = generate(model, PROMPT, max_new_tokens=12, exit_policy=policy)
        assert result.token_ids == plain.token_ids, policy
        assert result.stats["mean_steps"] == 4


POLICIES = ["confidence=0.05,min=1", "entropy=4.0,min=2", "cosine=0.3,min=1", "confidence=0.0,min=2,every=2",
            "confidence=0.05,min=1,kv=verify", "cosine=0.3,min=2,kv=verify"]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
@pytest.mark.parametrize("policy", POLICIES)
def test_dynamic_exit_draft_is_lossless(arch, policy):
    model = tiny_model(arch, num_layers=4)
    plain = generate(model, PROMPT, max_new_tokens=16)
    drafter = make_drafter(f"dynamic:{policy}", model)
    result = generate(model, PROMPT, max_new_tokens=16, draft=drafter, draft_length="fixed")
    assert result.token_ids == plain.token_ids
    assert result.stats["drafted"] > 0
    exits = drafter.runner.exits
    assert exits and min(exits) >= ExitPolicy.parse(policy).min_steps


def test_callable_policy_sees_step_hidden_and_logits_and_decides():
    model = tiny_model("llama", num_layers=4)
    seen = []

    def exit_after_second(step_index, hidden, logits):
        seen.append((step_index, tuple(hidden.shape), None if logits is None else tuple(logits.shape)))
        return step_index == 1

    result = generate(model, PROMPT, max_new_tokens=6, exit_policy=ExitPolicy.from_callable(exit_after_second))
    assert result.stats["mean_steps"] == 2
    assert seen[0] == (0, (1, 1, 32), (96,)) and seen[1][0] == 1
    blind = ExitPolicy.from_callable(lambda i, h, logits: logits is None and i == 2, needs_logits=False)
    assert generate(model, PROMPT, max_new_tokens=4, exit_policy=blind).stats["mean_steps"] == 3


def test_propagation_writes_calm_kv_for_the_skipped_layers():
    """After an exit at step 2 of 4, layers 2 and 3 hold K/V computed from the exited state
    (their own k/v projections of their input norm of it, with RoPE), as CALM prescribes."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama", num_layers=4)
    plan = model.plan()
    cache = new_cache(plan, 32)
    ids = torch.tensor([PROMPT])
    run_hidden(model, ids, plan, cache, 0)
    exited = {}

    def at_two(step_index, hidden, logits):
        if step_index == 1:
            exited["hidden"] = hidden.clone()
            return True
        return False

    position = len(PROMPT)
    DynamicExit(model, plan, ExitPolicy.from_callable(at_two, needs_logits=False))(3, cache, position)
    hidden = exited["hidden"]  # (1, 1, H)
    for layer_index in (2, 3):
        layer = model.hf.model.layers[layer_index]
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        shape = (1, 1, -1, attention.head_dim)
        key = attention.k_proj(normed).view(shape).transpose(1, 2)
        value = attention.v_proj(normed).view(shape).transpose(1, 2)
        cos, sin = model.hf.model.rotary_emb(hidden, torch.tensor([[position]]))
        _, key = apply_rotary_pos_emb(key, key, cos, sin)
        torch.testing.assert_close(cache.keys[layer_index][:, :, position : position + 1], key)
        torch.testing.assert_close(cache.values[layer_index][:, :, position : position + 1], value)
        assert cache.lengths[layer_index] == position + 1


def test_reduced_head_scores_the_subset_exactly_and_nothing_else():
    model = tiny_model("gemma3", num_layers=2)  # soft-capped logits
    ids = torch.tensor([0, 2, 3, 17, 50, 95])
    hidden = torch.randn(1, 3, 32)
    full = head(model, hidden)
    reduced = ReducedHead(model, ids)(hidden)
    torch.testing.assert_close(reduced[..., ids], full[..., ids])
    outside = torch.ones(96, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(reduced[..., outside]).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_reduced_vocabulary_draft_is_lossless(arch):
    model = tiny_model(arch, num_layers=4)
    plain = generate(model, PROMPT, max_new_tokens=16)
    for k in (8, 48, 96):
        subset = torch.randperm(96, generator=torch.Generator().manual_seed(k))[:k]
        drafter = PlanDrafter(model.plan("exit:2"), head=ReducedHead(model, subset))
        result = generate(model, PROMPT, max_new_tokens=16, draft=drafter, draft_length="fixed")
        assert result.token_ids == plain.token_ids
    dynamic = DynamicExitDrafter(model, model.plan(), ExitPolicy.parse("confidence=0.05,min=1"),
                                 head=ReducedHead(model, torch.arange(0, 96, 3)))
    assert generate(model, PROMPT, max_new_tokens=16, draft=dynamic).token_ids == plain.token_ids


def test_sampling_with_a_reduced_draft_keeps_draft_probabilities_on_the_subset():
    model = tiny_model("llama", num_layers=4)
    subset = torch.arange(0, 96, 2)
    drafter = PlanDrafter(model.plan("exit:2"), head=ReducedHead(model, subset))
    from layerplan.decoding.choice import seeded_generator
    from layerplan.decoding.drafters.proposal import DraftState
    from layerplan.decoding.sampling_params import SamplingParams

    cache = new_cache(model.plan(), 64)
    run_hidden(model, torch.tensor([PROMPT[:-1]]), model.plan(), cache, 0)
    state = DraftState(model, model.plan(), cache, list(PROMPT), SamplingParams(temperature=1.0),
                       seeded_generator(0), passes=ModelPasses(model))
    proposal = drafter.propose(state, 4)
    np.testing.assert_allclose(proposal.probs.sum(-1), np.ones(len(proposal.tokens)))
    assert float(proposal.probs[:, 1::2].sum()) == 0.0 and all(t % 2 == 0 for t in proposal.tokens)


@pytest.mark.parametrize("text, message", [
    ("confidence", "expected e.g."),
    ("speed=3", "unknown exit policy 'speed'"),
    ("confidence=0.9,depth=3", "unknown exit policy option 'depth'"),
    ("confidence=high", "cannot read the threshold"),
    ("confidence=1.5", "probability"),
    ("cosine=0.9,kv=maybe", "kv must be"),
    ("entropy=1,min=0", "min and every"),
])
def test_bad_exit_policies_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        ExitPolicy.parse(text)


def test_lossy_exit_policy_and_draft_do_not_mix():
    model = tiny_model("llama", num_layers=2)
    with pytest.raises(ValueError, match="dynamic:POLICY"):
        generate(model, PROMPT, max_new_tokens=2, draft="ngram", exit_policy="confidence=0.5")


@pytest.mark.real
def test_real_model_dynamic_and_reduced_vocab_drafts_are_lossless(smollm2):
    prompt = smollm2.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    plain = generate(smollm2, prompt, max_new_tokens=24)
    for draft in ("dynamic:confidence=0.6,min=16", "exit:24+vocab=4096"):
        result = generate(smollm2, prompt, max_new_tokens=24, draft=draft, draft_length="fixed")
        assert result.token_ids == plain.token_ids, draft
    ids = frequent_tokens(smollm2, 4096)
    assert 4096 <= len(ids) <= 4096 + 32 and set(smollm2.eos_token_ids) <= set(ids.tolist())
    # a text with fewer distinct tokens than K: its tokens, the special ones, then the lowest ids
    text = "hello hello world"
    short = frequent_tokens(smollm2, 100, text).tolist()
    assert len(short) == 100 and short == sorted(set(short))
    assert set(smollm2.tokenizer.encode(text, add_special_tokens=False)) <= set(short)
    assert set(range(10)) <= set(short)
