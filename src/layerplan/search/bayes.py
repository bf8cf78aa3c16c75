"""Bayesian search over per-layer attention / MLP switches with Optuna.

Results live in an Optuna storage: a SQLite file by default, any RDB URL (PostgreSQL for a
team), or a journal file (`journal:PATH`). Several processes or machines running the same
command with the same storage and study name share one study. Interrupted runs resume: finished
trials are kept, the study stops at `n_trials` finished trials in total, and with an RDB storage
trials whose process died are retried (heartbeat + RetryFailedTrialCallback).
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from layerplan.plan.plan import LayerPlan, PlanError
from layerplan.search.evaluator import CostModel, PlanEvaluator
from layerplan.search.greedy import candidate_items
from layerplan.search.objectives import OBJECTIVES, score


@dataclass(frozen=True)
class Sampler:
    help: str
    make: Callable[[Any, int], Any]  # (the optuna module, seed) -> an Optuna sampler


SAMPLERS = {
    "tpe": Sampler("multivariate TPE (with --multi: NSGA-II)",
                   lambda optuna, seed: optuna.samplers.TPESampler(seed=seed, multivariate=True)),
    "gp": Sampler("Gaussian process", lambda optuna, seed: optuna.samplers.GPSampler(seed=seed)),
    "nsga2": Sampler("NSGA-II, a genetic algorithm", lambda optuna, seed: optuna.samplers.NSGAIISampler(seed=seed)),
    "random": Sampler("uniform random (a baseline)", lambda optuna, seed: optuna.samplers.RandomSampler(seed=seed)),
}


def make_storage(url: str | None, heartbeat: int = 60):
    import optuna

    if url is None:
        return None
    if url.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len("journal:"):])
        path.parent.mkdir(parents=True, exist_ok=True)  # a fresh --out folder
        return JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        Path(url).parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{url}"
    retry_class = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    keyword = ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback"
               in inspect.signature(optuna.storages.RDBStorage).parameters else "failed_trial_callback")
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(5):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # heartbeats are marked experimental
                return optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat, grace_period=2 * heartbeat,
                                                  **{keyword: retry_class(max_retry=3)})
        except (IntegrityError, OperationalError):
            # workers started together race to create the schema in an empty database: the
            # loser finds the tables made by the winner on the next try
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def plan_from_params(num_layers: int, params: dict[str, bool], model_name: str = "the model") -> LayerPlan:
    """Trial parameters {"attn_3": False, "mlp_7": True, ...} (False = skipped) as a plan."""
    attention = [int(k[5:]) for k, v in params.items() if k.startswith("attn_") and not v]
    mlp = [int(k[4:]) for k, v in params.items() if k.startswith("mlp_") and not v]
    return LayerPlan.from_skips(num_layers, attention=attention, mlp=mlp, model_name=model_name)


def params_from_plan(plan: LayerPlan, items) -> dict[str, bool]:
    skipped = plan.skipped()
    return {
        (f"attn_{i}" if kind == "attention" else f"mlp_{i}"): i not in skipped[kind]
        for kind, i in items
    }


@dataclass
class TrialRecord:
    number: int
    plan: str
    values: list[float]
    cost: float
    state: str


@dataclass
class StudyResult:
    study: str
    objective: str
    directions: list[str]
    best_plan: str
    best_value: float | None
    trials: list[TrialRecord] = field(default_factory=list)
    pareto: list[TrialRecord] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def ranked(self) -> list[TrialRecord]:
        """Finished trials, best first by the (first) objective."""
        done = [t for t in self.trials if t.state == "COMPLETE"]
        return sorted(done, key=lambda t: t.values[0], reverse=self.directions[0] == "maximize")


def run_study(
    evaluator: PlanEvaluator,
    objective: str,
    n_trials: int,
    storage: str | None = None,
    study_name: str | None = None,
    sampler: str = "tpe",
    multi_objective: bool = False,
    seeds: list[LayerPlan] = (),
    allow_ends: bool = False,
    costs: CostModel | None = None,
    prompts=None,
    seed: int = 0,
    on_trial: Callable[[int, int], None] | None = None,
) -> StudyResult:
    """Optimise `objective` (and, with multi_objective, the plan's relative cost too, minimised).
    `seeds` (e.g. the greedy result, the full model) are enqueued as the first trials."""
    import optuna
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler '{sampler}'; choose from {', '.join(SAMPLERS)}")
    model = evaluator.model
    items = [item for item in candidate_items(model.num_layers, "sublayer", allow_ends)]
    directions = [OBJECTIVES[objective].direction] + (["minimize"] if multi_objective else [])
    chosen = SAMPLERS[sampler if not (multi_objective and sampler == "tpe") else "nsga2"].make(optuna, seed)
    name = study_name or f"{model.name}-{objective}{'-cost' if multi_objective else ''}"
    study = optuna.create_study(storage=make_storage(storage), study_name=name, directions=directions,
                                sampler=chosen, load_if_exists=True)
    if not study.trials:  # seed only a new study; a resumed one already has them
        for plan in seeds:
            study.enqueue_trial(params_from_plan(plan, items), skip_if_exists=True)

    def objective_fn(trial: optuna.Trial):
        params = {(f"attn_{i}" if kind == "attention" else f"mlp_{i}"): trial.suggest_categorical(
            f"attn_{i}" if kind == "attention" else f"mlp_{i}", [True, False]) for kind, i in items}
        try:
            plan = plan_from_params(model.num_layers, params, model.name)
        except PlanError as error:
            raise optuna.TrialPruned(str(error)) from None
        trial.set_user_attr("plan", plan.to_string())
        trial.set_user_attr("cost", plan.cost)
        value = score(objective, plan, evaluator, costs, prompts)
        return (value, costs.relative_cost(plan) if costs else plan.cost) if multi_objective else value

    def progress(study_, trial) -> None:
        if on_trial:
            done = len(study_.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            on_trial(min(done, n_trials), n_trials)

    finished = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    if finished < n_trials:
        study.optimize(objective_fn, n_trials=n_trials - finished,
                       callbacks=[MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE,)), progress])
    return summarise(study, objective, directions)


def summarise(study, objective: str, directions: list[str]) -> StudyResult:
    from optuna.trial import TrialState

    def record(t) -> TrialRecord:
        return TrialRecord(t.number, t.user_attrs.get("plan", ""), list(t.values or []),
                           t.user_attrs.get("cost", float("nan")), t.state.name)

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    trials = [record(t) for t in study.get_trials(deepcopy=False)]
    if len(directions) == 1:
        best = study.best_trial if complete else None
        return StudyResult(study.study_name, objective, directions, best.user_attrs["plan"] if best else "full",
                           best.value if best else None, trials)
    pareto = [record(t) for t in study.best_trials]
    # a single answer from the front: the best objective among plans at most 80% of the cost
    sign = 1 if directions[0] == "minimize" else -1
    cheap = [p for p in pareto if p.values[1] <= 0.8] or pareto
    pick = min(cheap, key=lambda p: sign * p.values[0]) if cheap else None
    return StudyResult(study.study_name, objective, directions, pick.plan if pick else "full",
                       pick.values[0] if pick else None, trials, pareto)
