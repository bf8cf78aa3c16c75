"""Explore in-situ frankenmerges: perplexity of many layer orders against the compute they add."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from layerplan.engine.runner import forward
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan, PlanError, Step, recompute_rewind_layers
from layerplan.search.evaluate import Reference


@dataclass(frozen=True)
class ExploreRow:
    plan: str
    steps: int
    added_compute: float  # steps / layers − 1 (0 for the model itself)
    perplexity: float
    kl: float  # to the full model
    top1_agreement: float


@dataclass
class ExploreResult:
    model: str
    tokens: int
    base_perplexity: float
    rows: list[ExploreRow] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def best(self) -> ExploreRow:
        return min(self.rows, key=lambda r: r.perplexity)

    def table(self) -> str:
        lines = [f"{'plan':<40} {'steps':>5} {'+compute':>8} {'ppl':>9} {'KL':>7} {'top1':>6}"]
        for row in sorted(self.rows, key=lambda r: r.added_compute):
            lines.append(f"{row.plan[:40]:<40} {row.steps:>5} {row.added_compute:>+8.0%} {row.perplexity:>9.3f} "
                         f"{row.kl:>7.4f} {row.top1_agreement:>6.3f}")
        return "\n".join(lines)


def recompute_rewind_grid(model: LoadedModel, recompute: Sequence[int], rewind: Sequence[int]) -> list[LayerPlan]:
    """Every (recompute, rewind) pair with 0 < rewind < recompute, as plans (duplicates dropped)."""
    plans: dict[tuple[int, ...], LayerPlan] = {}
    for n in recompute:
        for m in rewind:
            if 0 < m < n:
                layers = tuple(recompute_rewind_layers(model.num_layers, n, m))
                plans.setdefault(layers, LayerPlan(tuple(Step(i) for i in layers), model.num_layers,
                                                   model_name=model.name))
    if not plans:
        raise PlanError("the grid has no pair with 0 < rewind < recompute")
    return list(plans.values())


@torch.inference_mode()
def explore(model: LoadedModel, ids: torch.Tensor, plans: Sequence[LayerPlan],
            on_progress: Callable[[int, int], None] | None = None) -> ExploreResult:
    start = time.perf_counter()
    reference = Reference(forward(model, ids), ids)
    result = ExploreResult(model.name, int(ids.numel()), reference.perplexity)
    for done, plan in enumerate(plans, 1):
        metrics = reference.divergence(forward(model, ids, plan))
        result.rows.append(ExploreRow(plan.to_string(), len(plan.active_steps),
                                      len(plan.active_steps) / model.num_layers - 1.0,
                                      metrics.perplexity, metrics.kl, metrics.top1_agreement))
        if on_progress:
            on_progress(done, len(plans))
    result.seconds = time.perf_counter() - start
    return result
