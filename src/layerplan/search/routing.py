"""Per-expert routing share of a mixture-of-experts model on calibration text (a first step toward
expert pruning): for every plan step whose MLP is a mixture-of-experts block, the fraction of the
router's top-k selections that went to each expert.

Read from the routers' own outputs by forward hooks on the router modules (architectures.py knows
where they are and what they return); the model runs by the plan runner, eagerly, once.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from layerplan.engine.runner import run_hidden
from layerplan.models.arch_table import ARCHITECTURES
from layerplan.models.architectures import expert_selections, router_of
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.importance import ExpertRouting


@torch.inference_mode()
def routing_shares(model: LoadedModel, ids: torch.Tensor, plan: LayerPlan | None = None) -> list[ExpertRouting]:
    """Routing share per step of `plan` on ids (B, T); empty for a model without routers."""
    plan = plan if plan is not None else model.plan()
    model_type = model.hf.config.model_type
    spec = ARCHITECTURES.get(model_type)
    if spec is not None and spec.kernels is not None:  # the kernels read dense gated MLPs: no router
        return []
    counts: dict[int, torch.Tensor] = {}
    current = [0]  # the step whose MLP runs next (the runner's observer says)

    def observe(index: int, sub_layer: str, hidden: torch.Tensor) -> None:
        current[0] = index

    def record(module, inputs, output) -> None:
        selections = expert_selections(model_type, output)
        if selections is not None:
            step = current[0]
            counts[step] = counts[step] + selections if step in counts else selections.clone()

    routers = {id(r): r for step in plan.active_steps
               if (r := router_of(model.layers_of(step.model)[step.layer].mlp)) is not None}
    if not routers:
        return []
    hooks = [router.register_forward_hook(record) for router in routers.values()]
    try:  # eagerly: the native kernels would not call the routers' modules
        run_hidden(replace(model, executor=None) if model.native is not None else model, ids, plan, observe=observe)
    finally:
        for hook in hooks:
            hook.remove()
    return [ExpertRouting(index, plan.steps[index].layer, int(found.sum()),
                          tuple(float(c) / max(int(found.sum()), 1) for c in found.tolist()))
            for index, found in sorted(counts.items())]
