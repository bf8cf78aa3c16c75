"""Explore in-situ frankenmerges: perplexity of many layer orders against the compute they add. No
torch: a front end gives each plan's logits (search/evaluator.py explore, lite/cli.py run_explore)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from layerplan.plan.plan import LayerPlan, PlanError, Step, recompute_rewind_layers
from layerplan.search.reference import LogitsOfRows, LogitsReference


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


def grid_numbers(name: str, value: str) -> list[int]:
    """--recompute / --rewind (`name`): integers separated by commas."""
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} takes integers separated by commas, got '{value}'") from None


def recompute_rewind_grid(model, recompute: Sequence[int], rewind: Sequence[int]) -> list[LayerPlan]:
    """Every (recompute, rewind) pair with 0 < rewind < recompute, as plans of `model` (its
    num_layers and name; duplicates dropped)."""
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


def explore_plans(reference: LogitsReference, logits_of_plan: Callable[[LayerPlan], LogitsOfRows],
                  plans: Sequence[LayerPlan], model_name: str, num_layers: int,
                  on_progress: Callable[[int, int], None] | None = None) -> ExploreResult:
    """Each plan's perplexity, KL and top-1 agreement against the reference (the full model's
    distributions on the ids), its logits from logits_of_plan(plan), and the compute it adds."""
    start = time.perf_counter()
    result = ExploreResult(model_name, int(reference.ids.size), reference.perplexity)
    for done, plan in enumerate(plans, 1):
        metrics = reference.divergence(logits_of_plan(plan))
        result.rows.append(ExploreRow(plan.to_string(), len(plan.active_steps),
                                      len(plan.active_steps) / num_layers - 1.0,
                                      metrics.perplexity, metrics.kl, metrics.top1_agreement))
        if on_progress:
            on_progress(done, len(plans))
    result.seconds = time.perf_counter() - start
    return result
