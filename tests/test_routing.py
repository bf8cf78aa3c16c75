"""The scan's per-expert routing share on tiny mixture-of-experts models: per step the shares sum to
1 and equal a hand computation of the top-k choices from the router logits (router weight times the
normed MLP input), for the common router output and for JetMoE's (the exception)."""

import json
from functools import cache

import pytest
import torch
from transformers import AutoConfig

from layerplan.engine.runner import run_hidden
from layerplan.models import discovery
from layerplan.models.architectures import router_of
from layerplan.models.loading import LoadedModel
from layerplan.search.routing import routing_shares
from layerplan.search.scan import scan
from tiny import tiny_model

ARCHS = ("mixtral", "qwen2_moe", "jetmoe")


@cache
def moe(arch: str) -> LoadedModel:
    hf = discovery.tiny_model(discovery.tiny_config(AutoConfig.for_model(arch)), seed=0)
    return LoadedModel(name=f"tiny-{arch}", hf=hf, tokenizer=None, source="tiny", require_check=False)


def ids_of(model: LoadedModel, length: int = 24) -> torch.Tensor:
    return torch.randint(3, model.hf.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(4))


def hand_shares(model: LoadedModel, ids: torch.Tensor, plan) -> dict[int, torch.Tensor]:
    """Per step: top-k of (MLP input after its norm) @ router weight^T, counted per expert."""
    top_k = model.hf.config.num_experts_per_tok
    found = {}

    def observe(index, sub_layer, hidden):
        step = plan.steps[index]
        layer = model.layers_of(step.model)[step.layer]
        router = router_of(layer.mlp)
        if sub_layer == "mlp" and step.mlp and router is not None:
            weight = next(p for p in router.parameters() if p.dim() == 2)  # (experts, hidden)
            logits = layer.mlp_norm(hidden).reshape(-1, hidden.shape[-1]) @ weight.T
            chosen = logits.topk(top_k, dim=-1).indices
            found[index] = torch.bincount(chosen.reshape(-1), minlength=weight.shape[0]).double() / chosen.numel()

    run_hidden(model, ids, plan, observe=observe)
    return found


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("plan_text", [None, "0,1,1,2;skip:mlp=0"])
def test_routing_shares_match_the_router_logits(arch, plan_text):
    model = moe(arch)
    plan = model.plan(plan_text)
    ids = ids_of(model)
    routing = routing_shares(model, ids, plan)
    expected = hand_shares(model, ids, plan)
    assert [r.step for r in routing] == sorted(expected) and expected
    for item in routing:
        assert item.layer == plan.steps[item.step].layer
        assert item.selections == ids.numel() * model.hf.config.num_experts_per_tok
        assert sum(item.shares) == pytest.approx(1.0)
        assert torch.tensor(item.shares, dtype=torch.double) == pytest.approx(expected[item.step], abs=1e-12)


def test_the_scan_reports_routing_for_moe_models_only():
    model = moe("mixtral")
    result = scan(model, ids_of(model, 12), kinds=["mlp"])
    experts = model.hf.config.num_local_experts
    assert len(result.routing) == model.num_layers and len(result.routing[0].shares) == experts
    assert json.loads(json.dumps(result.to_dict()))["routing"][0]["shares"] == list(result.routing[0].shares)
    assert "expert routing share" in result.table() and f"e{experts - 1}" in result.table()
    dense = tiny_model("llama", num_layers=2)
    assert scan(dense, ids_of(dense, 12), kinds=["mlp"]).routing == []


def test_many_experts_print_their_extremes():
    from layerplan.search.importance import ExpertRouting

    shares = tuple([0.0] * 30 + [0.25, 0.75])
    line = ExpertRouting(0, 0, 8, shares).line()
    assert line.startswith("32 experts; most chosen e31 75.0%, e30 25.0%") and "never chosen 30" in line
