"""The search policy without torch: greedy skipping and/or an Optuna study over a front end's
evaluator (search/reference.py ResumingEvaluator), the costs and the timed speed it is given, and
the best plan kept for the `auto` drafter. search/run.py gives it the torch front end's model,
lite/searching.py the light one's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from layerplan.decoding.drafters.saved import save_draft_plan
from layerplan.plan.plan import LayerPlan
from layerplan.search.bayes import StudyResult, run_study
from layerplan.search.greedy import GreedyResult, greedy_search
from layerplan.search.objectives import OBJECTIVES
from layerplan.search.patience import DEFAULT_PATIENCE
from layerplan.search.reference import CostModel, ResumingEvaluator
from layerplan.search.windows import Divergence

METHODS = {
    "greedy": "greedy skipping",
    "bayes": "an Optuna study",
    "both": "greedy first and its result seeding the study",
}


@dataclass
class SearchResult:
    objective: str
    multi: bool
    best_plan: LayerPlan
    best: Divergence  # the best plan against the full model on the calibration ids
    costs: CostModel | None = None
    greedy: GreedyResult | None = None
    study: StudyResult | None = None
    saved_draft: Path | None = None  # where the best plan was kept for the `auto` drafter

    @property
    def draft_worthy(self) -> bool:
        """The objective looks for a draft and the search found a plan that is not the model itself."""
        return OBJECTIVES[self.objective].drafts and not self.best_plan.is_identity

    def to_dict(self) -> dict:
        report: dict = {"objective": self.objective, "multi": self.multi}
        if self.costs is not None:
            report["costs"] = self.costs.to_dict()
        if self.greedy is not None:
            report["greedy"] = self.greedy.to_dict()
        if self.study is not None:
            report["study"] = self.study.to_dict()
        report["best_plan"] = self.best_plan.to_string()
        report["best"] = asdict(self.best)
        if self.costs is not None:
            report["best"]["relative_cost"] = self.costs.relative_cost(self.best_plan)
        return report


def check_method(method: str, objective: str):
    """The objective's registry row, where the method can search for it (ValueError in one line
    else): the commands ask before they load a model."""
    if method not in METHODS:
        raise ValueError(f"unknown search method '{method}'; choose from {', '.join(METHODS)}")
    chosen = OBJECTIVES.get(objective)
    if chosen is None:
        raise ValueError(f"unknown objective '{objective}'; choose from {', '.join(OBJECTIVES)}")
    if method == "greedy" and chosen.greedy_as:
        raise ValueError(f"greedy search scores many candidates per pass; use --method bayes for {objective}")
    return chosen


def search_plans(
    evaluator: ResumingEvaluator,
    objective: str = "speedup",
    method: str = "both",
    multi: bool = False,
    trials: int = 100,
    budget: int | None = None,
    max_cost_cut: float | None = None,
    granularity: str = "sublayer",
    mode: str = "forward",
    sampler: str = "tpe",
    storage: str | None = None,
    study_name: str | None = None,
    allow_ends: bool = False,
    seed: int | None = None,
    measure_costs: Callable[[], CostModel] | None = None,
    timed_speed: Callable[[LayerPlan], float] | None = None,
    folder: str | Path = "runs/search",
    on_stage: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    save_draft: bool | None = False,
    storage_patience: float = DEFAULT_PATIENCE,
) -> SearchResult:
    """Search a plan of evaluator.model for `objective` against the evaluator's reference plan.

    budget: greedy items to switch (default 20 unless max_cost_cut says when to stop);
    measure_costs(): the model's cost model, measured where an objective (or multi) needs it;
    timed_speed(plan): the tokens-per-second objective's measured speed; folder: greedy's state
    file and the default study storage (folder/study.db), so that the same call resumes; seed:
    makes the study's sampler seeds reproducible (None: fresh ones each run; see
    bayes.derive_seed). save_draft: keep the best plan as the `auto` drafter's layer-plan draft
    (decoding/drafters/saved.py); None: when the objective looks for a draft
    (SearchResult.draft_worthy). storage_patience: seconds the study waits for an unreachable
    database server (layerplan.search.patience)."""
    chosen = check_method(method, objective)
    model, folder = evaluator.model, Path(folder)
    greedy_objective = chosen.greedy_as or objective
    costs = None
    if multi or OBJECTIVES[greedy_objective].needs_costs or chosen.needs_costs:
        if measure_costs is None:
            raise ValueError(f"the {objective} objective weighs measured costs: give measure_costs")
        costs = measure_costs()
    seeds = [model.plan()]
    best, greedy, study = None, None, None
    if method in ("greedy", "both"):
        _stage(on_stage, "greedy pass")
        greedy = greedy_search(evaluator, greedy_objective,
                               budget=budget if budget is not None else (None if max_cost_cut else 20),
                               max_cost_cut=max_cost_cut, granularity=granularity, mode=mode, allow_ends=allow_ends,
                               state_file=folder / f"greedy-{objective}-{mode}-{granularity}.json",
                               costs=costs, on_progress=on_progress)
        if greedy.steps:
            best = greedy.best_plan
            seeds.append(model.plan(best))
    if method in ("bayes", "both"):
        _stage(on_stage, "trials")
        study = run_study(evaluator, objective, trials, str(storage or folder / "study.db"), study_name, sampler,
                          multi, seeds, allow_ends, costs, timed_speed, seed, on_trial=on_progress,
                          patience=storage_patience)
        best = study.best_plan
    best_plan = model.plan(best or "full")
    result = SearchResult(objective, multi, best_plan, evaluator.divergence(best_plan), costs, greedy, study)
    if save_draft or (save_draft is None and result.draft_worthy):
        result.saved_draft = save_draft_plan(model, best_plan)
    return result


def _stage(on_stage: Callable[[str], None] | None, text: str) -> None:
    if on_stage:
        on_stage(text)
