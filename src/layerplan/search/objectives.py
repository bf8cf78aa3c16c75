"""What a search optimises: the objectives (one registry, OBJECTIVES, that the CLI's choices and
help come from) and the value of one plan under each. No torch: a plan's measured decoding speed
(tokens-per-second) comes from the caller (search/run.py speed_on_prompts)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from layerplan.decoding.draft_length import expected_speedup
from layerplan.plan.plan import LayerPlan
from layerplan.search.reference import CostModel, ResumingEvaluator
from layerplan.search.windows import Divergence


@dataclass(frozen=True)
class Objective:
    name: str
    direction: str  # "minimize" or "maximize"
    help: str
    needs_costs: bool = False  # scored with a measured CostModel
    # the value weighs quality against cost (a speedup): the best-valued plan is the answer; a
    # quality-only value can only get worse with each skip, and the answer is the plan at the budget
    weighs_cost: bool = False
    needs_prompts: bool = False  # scored by decoding prompts (token ids)
    drafts: bool = False  # looks for a speculative draft: the best plan is saved for --draft auto by default
    greedy_as: str | None = None  # too slow to score many candidates: greedy search optimises this one instead


OBJECTIVES = {o.name: o for o in (
    Objective("kl", "minimize", "mean KL(full model || plan) per token on the calibration text"),
    Objective("ppl", "minimize", "perplexity of the plan on the calibration text"),
    Objective("agreement", "maximize", "top-1 agreement with the full model (= greedy draft acceptance)",
              drafts=True),
    Objective("speedup", "maximize", "predicted self-speculative speedup from agreement and the measured cost "
              "of the plan", needs_costs=True, weighs_cost=True, drafts=True),
    Objective("tokens-per-second", "maximize", "measured speculative decoding speed on the prompts (slow, honest)",
              needs_prompts=True, weighs_cost=True, drafts=True, greedy_as="speedup"),
)}


def objectives_help() -> str:
    """One line per objective, for the CLI."""
    return "\n".join(f"  {o.name:<18} {o.help} ({'minimise' if o.direction == 'minimize' else 'maximise'})"
                     for o in OBJECTIVES.values())


def score(objective: str, plan: LayerPlan, evaluator: ResumingEvaluator, costs: CostModel | None = None,
          timed_speed: Callable[[LayerPlan], float] | None = None, bound: float | None = None) -> float:
    """The objective's value for one plan (see OBJECTIVES). timed_speed(plan): tokens a second of
    speculative decoding with the plan as its draft (the tokens-per-second objective).

    bound: the caller only cares whether the value beats this; scoring may stop early and return
    a bound that is worse than it (a lower bound for minimised objectives, an upper bound for
    maximised ones). Used by greedy search to drop candidates that would be pruned anyway."""
    if objective == "tokens-per-second":
        if timed_speed is None:
            raise ValueError("the tokens-per-second objective times speculative decoding on prompts: give some "
                             "(token ids), or choose another objective")
        return timed_speed(plan)
    give_up = None
    if bound is not None:
        # stop scoring once even the best case for the unscored positions cannot beat `bound`
        sign = 1.0 if OBJECTIVES[objective].direction == "minimize" else -1.0

        def give_up(bounds: Divergence) -> bool:
            return sign * _value(objective, bounds, plan, costs) > sign * bound
    return _value(objective, evaluator.divergence(plan, give_up), plan, costs)


def _value(objective: str, metrics: Divergence, plan: LayerPlan, costs: CostModel | None) -> float:
    if objective == "kl":
        return metrics.kl
    if objective == "ppl":
        return metrics.perplexity
    if objective == "agreement":
        return metrics.top1_agreement
    if objective == "speedup":
        if costs is None:
            raise ValueError("the speedup objective needs a measured cost model")
        c = costs.relative_cost(plan)
        return max(expected_speedup(metrics.top1_agreement, gamma, c) for gamma in range(1, 9))
    raise ValueError(f"unknown objective '{objective}'; choose from {', '.join(OBJECTIVES)}")
