"""In-situ frankenmerges: generated orders, exports that transformers loads, exploration."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerplan.engine.runner import forward, new_cache
from layerplan.export import export_checkpoint
from layerplan.plan.formats import from_mergekit, to_mergekit
from layerplan.plan.plan import PlanError, parse_plan, recompute_rewind_layers
from layerplan.search.evaluator import explore
from layerplan.search.explore import recompute_rewind_grid
from tiny import VOCAB, tiny_model


def test_recompute_rewind_pattern():
    assert recompute_rewind_layers(16, 8, 4) == list(range(8)) + list(range(4, 12)) + list(range(8, 16))
    assert [s.layer for s in parse_plan("pattern:recompute=3,rewind=1", 5).steps] == [0, 1, 2, 2, 3, 4]
    with pytest.raises(PlanError, match="0 <= rewind < recompute"):
        parse_plan("pattern:recompute=3,rewind=3", 5)
    with pytest.raises(PlanError, match="expected recompute=N,rewind=M"):
        parse_plan("pattern:every=3", 5)


def test_fractional_chunks():
    plan = parse_plan("frac:0.0-0.6,0.2-0.8,0.6-1.0", 10)
    assert [s.layer for s in plan.steps] == list(range(6)) + list(range(2, 8)) + list(range(6, 10))
    with pytest.raises(PlanError, match="0 <= A < B <= 1"):
        parse_plan("frac:0.5-0.2", 10)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gpt2"])
@pytest.mark.parametrize("plan_text", ["0,1,1,2", "0-2,1*2@0.5", "0/mlp,1,2/attn,1@0.25"])
def test_export_then_transformers_load_equals_in_memory_plan(arch, plan_text, tmp_path):
    """Repeats, weighted repeats and switched-off sub-layers are all folded into real weights."""
    model = tiny_model(arch, num_layers=3)
    plan = model.plan(plan_text)
    folder = export_checkpoint(model, plan, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    assert loaded.config.num_hidden_layers == len(plan.steps)
    if getattr(loaded.config, "layer_types", None) is not None:
        assert loaded.config.layer_types == [model.hf.config.layer_types[s.layer] for s in plan.steps]
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = loaded(ids).logits
    assert (forward(model, ids, plan) - reference).abs().max() < 1e-4
    cache = new_cache(plan)  # and through incremental decoding
    pieces = [forward(model, ids[:, :7], plan, cache, 0)] + [
        forward(model, ids[:, t : t + 1], plan, cache, t) for t in range(7, 12)]
    assert (torch.cat(pieces, 1) - reference).abs().max() < 1e-4


def test_mergekit_multi_slice_multi_model_round_trip():
    text = to_mergekit(parse_plan("0-5,3-9", 10), "org/base")
    assert from_mergekit(text, 10) == parse_plan("0-5,3-9", 10)
    two = """
slices:
  - sources: [{model: org/A, layer_range: [0, 6]}]
  - sources: [{model: org/B, layer_range: [3, 10]}]
  - sources: [{model: org/A, layer_range: [8, 10]}]
merge_method: passthrough
"""
    plan = from_mergekit(two, 10)
    assert plan.to_string() == "a:0-5,b:3-9,a:8-9"
    assert from_mergekit(to_mergekit(plan, "org/A", sources={"b": "org/B"}), 10) == plan
    with pytest.raises(PlanError, match="give their paths"):
        to_mergekit(plan, "org/A")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_two_model_plan_equals_the_merged_checkpoint(arch, tmp_path):
    model = tiny_model(arch, num_layers=3, seed=0)
    other = tiny_model(arch, num_layers=3, seed=1)
    model.attach(other, "b")
    plan = model.plan("a:0-1,b:1-2,a:2")
    assert plan.models == ("b",)
    folder = export_checkpoint(model, plan, tmp_path / "two")
    merged = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = merged(ids).logits
    assert (forward(model, ids, plan) - reference).abs().max() < 1e-4
    cache = new_cache(plan)
    pieces = [forward(model, ids[:, :6], plan, cache, 0)] + [
        forward(model, ids[:, t : t + 1], plan, cache, t) for t in range(6, 12)]
    assert (torch.cat(pieces, 1) - reference).abs().max() < 1e-4
    # the second model's layers really are used
    assert (forward(model, ids, model.plan("0-1,1-2,2")) - reference).abs().max() > 1e-3


def test_two_model_errors_come_before_any_computation():
    model = tiny_model("llama", num_layers=3)
    with pytest.raises(PlanError, match="takes layers from model.s. b, but only a is loaded"):
        model.plan("a:0-1,b:1-2")
    with pytest.raises(PlanError, match="hidden_size is 64, not 32"):
        bigger = tiny_model("llama", num_layers=3)
        bigger.hf.config.hidden_size = 64
        model.attach(bigger, "b")
    with pytest.raises(PlanError, match="does not match .*num_hidden_layers is 4, not 3"):
        model.attach(tiny_model("llama", num_layers=4), "b")
    with pytest.raises(PlanError, match="'a' is this model"):
        model.attach(tiny_model("llama", num_layers=3), "a")
    with pytest.raises(PlanError, match="layer 3 is out of range"):
        model.plan("b:0-3")


def test_explore_grid_ranks_orders_against_the_full_model():
    model = tiny_model("llama", num_layers=4)
    plans = recompute_rewind_grid(model, [2, 3], [1, 2])
    assert [p.to_string() for p in plans] == ["0-1,1-2,2-3", "0-2,2-3", "0-2,1-3"]
    ids = torch.randint(3, VOCAB, (1, 24))
    result = explore(model, ids, plans + [model.plan()])
    full = next(r for r in result.rows if r.plan == "full")
    assert full.kl < 1e-6 and full.added_compute == 0.0
    assert next(r for r in result.rows if r.plan == "0-1,1-2,2-3").added_compute == pytest.approx(0.5)
    with pytest.raises(PlanError, match="no pair"):
        recompute_rewind_grid(model, [2], [2])
