"""Greedy (incremental) skipping, as in the llama.cpp layer-skip demo, and its reverse.

forward mode: repeatedly switch off the item (sub-layer or whole layer) whose removal hurts the
objective least, re-scoring the remaining items with it off. anti mode: start with everything
but the protected ends off and switch back on the item that helps most.

Each pass is one scan against the current plan (every candidate resumes from the full model's
stream at its first change). Candidates that ranked in the worst `prune` fraction in a pass are
dropped from later passes (never below `min_alive`), and a candidate whose partial score already
proves it would be dropped stops being scored. A state file lets an interrupted search resume where it stopped.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerplan.files import write_json_atomic
from layerplan.plan.plan import LayerPlan, PlanError
from layerplan.search.objectives import OBJECTIVES, score
from layerplan.search.reference import ResumingEvaluator

Item = tuple[str, int]  # ("attention" | "mlp" | "layer", layer index)


@dataclass
class GreedyStep:
    item: str  # e.g. "attention 7"
    plan: str
    value: float  # objective after this step
    cost: float  # plan.cost: fraction of sub-layers still running


@dataclass
class GreedyResult:
    model: str
    objective: str
    mode: str
    steps: list[GreedyStep] = field(default_factory=list)
    evaluations: int = 0

    @property
    def best_step(self) -> GreedyStep | None:
        """The step whose plan is the search's answer (the CLI's, the report's, the study's seed):
        the best-valued step for an objective that weighs cost (speedup), else the last one (a
        quality-only objective gets worse with every skip; the budget says how far to go)."""
        if not self.steps:
            return None
        objective = OBJECTIVES[self.objective]
        if not objective.weighs_cost:
            return self.steps[-1]
        pick = min if objective.direction == "minimize" else max
        return pick(self.steps, key=lambda step: step.value)

    @property
    def best_plan(self) -> str:
        best = self.best_step
        return best.plan if best is not None else "full"

    def to_dict(self) -> dict:
        return asdict(self) | {"best_plan": self.best_plan}


def candidate_items(num_layers: int, granularity: str, allow_ends: bool) -> list[Item]:
    layers = range(num_layers) if allow_ends else range(1, num_layers - 1)
    if granularity == "layer":
        return [("layer", i) for i in layers]
    return [(kind, i) for i in layers for kind in ("attention", "mlp")]


def _switch(plan: LayerPlan, item: Item, on: bool) -> LayerPlan:
    kind, layer = item
    steps = [i for i, s in enumerate(plan.steps) if s.layer == layer]
    for index in steps:
        if kind in ("attention", "layer"):
            plan = plan.with_step(index, attention=on)
        if kind in ("mlp", "layer"):
            plan = plan.with_step(index, mlp=on)
    return plan


def greedy_search(
    evaluator: ResumingEvaluator,
    objective: str = "kl",
    budget: int | None = None,
    max_cost_cut: float | None = None,
    granularity: str = "sublayer",
    mode: str = "forward",
    allow_ends: bool = False,
    prune: float = 0.3,
    min_alive: int = 8,
    state_file: str | Path | None = None,
    costs=None,
    on_progress: Callable[[int, int], None] | None = None,
    early_abort: bool = True,
) -> GreedyResult:
    """budget: items to switch (default: until max_cost_cut or all); max_cost_cut: stop once the
    plan's cost fell by this fraction (forward) / rose to 1 − this (anti). early_abort: stop
    scoring a candidate once its bound shows it would be pruned (same result, less work)."""
    model = evaluator.model
    if OBJECTIVES[objective].greedy_as:
        raise ValueError(f"greedy search scores many candidates per pass: optimise {OBJECTIVES[objective].greedy_as} "
                         f"instead of {objective}")
    sign = 1.0 if OBJECTIVES[objective].direction == "minimize" else -1.0
    items = candidate_items(model.num_layers, granularity, allow_ends)
    plan = evaluator.reference_plan
    if mode == "anti":
        for item in items:
            plan = _switch(plan, item, on=False)
    elif mode != "forward":
        raise ValueError(f"unknown greedy mode '{mode}'; use forward or anti")
    result = GreedyResult(model.name, objective, mode)
    state_path = Path(state_file) if state_file else None
    done_items: list[Item] = []
    if state_path is not None and state_path.exists():
        saved = json.loads(state_path.read_text())
        if (saved.get("model"), saved.get("objective"), saved.get("mode")) == (model.name, objective, mode):
            for record in saved["steps"]:
                kind, layer = record["item"].split()
                done_items.append((kind, int(layer)))
                plan = _switch(plan, done_items[-1], on=mode == "anti")
                result.steps.append(GreedyStep(**record))
    remaining = [i for i in items if i not in done_items]
    limit = budget if budget is not None else len(items)
    alive = list(remaining)
    while remaining and len(result.steps) < limit:
        if max_cost_cut is not None:
            cut = 1.0 - plan.cost
            if (mode == "forward" and cut >= max_cost_cut) or (mode == "anti" and cut <= max_cost_cut):
                break
        # the winner and the `keep` runners-up survive the pass; a candidate that provably
        # cannot rank among them is dropped mid-scoring (its value is then only a bound)
        keep = max(min_alive, int(len(alive) * (1 - prune))) if prune else len(alive)
        scored: list[tuple[float, Item, LayerPlan]] = []
        complete: list[float] = []  # sorted signed values of fully scored candidates
        for k, item in enumerate(alive, 1):
            try:
                candidate = _switch(plan, item, on=mode == "anti")
            except PlanError:
                continue  # would switch off everything
            bound = sign * complete[keep] if early_abort and len(complete) > keep else None
            aborted_before = evaluator.aborted
            value = sign * score(objective, candidate, evaluator, costs, bound=bound)
            if evaluator.aborted == aborted_before:
                complete.insert(bisect.bisect(complete, value), value)
            scored.append((value, item, candidate))
            if on_progress:
                on_progress(k, len(alive))
        if not scored:
            break
        scored.sort(key=lambda x: x[0])
        value, item, plan = scored[0]
        remaining.remove(item)
        # best first: the next pass meets strong candidates early, which tightens its bound
        alive = [i for _, i, _ in scored[1 : keep + 1]]
        result.steps.append(GreedyStep(f"{item[0]} {item[1]}", plan.to_string(), sign * value, plan.cost))
        if state_path is not None:
            write_json_atomic(state_path, result.to_dict())
    result.evaluations = evaluator.evaluations
    return result
