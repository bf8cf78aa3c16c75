"""`layerplan search`'s work on the torch front end's model (search/plan_search.py is the search:
greedy skipping and/or an Optuna study over an evaluator): its evaluator, its measured costs, and
the tokens-per-second objective's timed speculative decoding on prompts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from layerplan.decoding.speculative import speculative_generate
from layerplan.engine.probe_rows import ProbeRow
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.evaluator import PlanEvaluator, measure_costs
from layerplan.search.plan_search import SearchResult, search_plans


def speed_on_prompts(model: LoadedModel, prompts: list[torch.Tensor], probe_row: ProbeRow | None = None,
                     new_tokens: int = 32) -> Callable[[LayerPlan], float]:
    """The tokens-per-second objective's measure: tokens a second of speculative decoding of each
    prompt (token ids) with the plan as its draft, adaptive draft lengths (probe_row: this
    machine's verify costs)."""
    def timed_speed(plan: LayerPlan) -> float:
        total_tokens, total_seconds = 0, 0.0
        for ids in prompts:
            result = speculative_generate(model, ids, plan.to_string(), max_new_tokens=new_tokens,
                                          draft_length="adaptive", probe_row=probe_row)
            total_tokens += len(result.token_ids)
            total_seconds += result.seconds
        return total_tokens / total_seconds if total_seconds else 0.0

    return timed_speed


def run_search(model: LoadedModel, ids: torch.Tensor, objective: str = "speedup", method: str = "both", *,
               prompts: list[torch.Tensor] | None = None, probe_row: ProbeRow | None = None,
               **options) -> SearchResult:
    """Search a plan of `model` on calibration ids (B, T): search/plan_search.py search_plans (its
    options: objective, method, trials, folder, ...) on this model's evaluator and measured costs.
    prompts: encoded prompts for the tokens-per-second objective; probe_row: this machine's probe
    row for the model (engine/probe.py), the verify costs of its timed decoding."""
    return search_plans(PlanEvaluator(model, ids), objective, method, measure_costs=lambda: measure_costs(model),
                        timed_speed=speed_on_prompts(model, prompts, probe_row) if prompts else None, **options)
