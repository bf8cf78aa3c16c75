"""Explore in-situ frankenmerges: perplexity of many layer orders against the compute they add. No
torch: a front end gives each plan's logits (search/evaluator.py explore, lite/research.py run_explore).
Given a journal (explore_journal: beside explore.json), each finished plan's row is kept there, so
that the same grid started again after an interruption runs only the rest."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerplan.plan.plan import LayerPlan, PlanError, Step, recompute_rewind_layers
from layerplan.search.journal import RowJournal, ids_digest
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
    resumed: int = 0  # rows taken from an interrupted run's journal, not run again

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


def explore_journal(out: str | os.PathLike) -> RowJournal:
    """Where `layerplan explore --out OUT` keeps its grid's finished rows: beside explore.json."""
    return RowJournal(Path(out) / "explore.partial.jsonl")


def explore_plans(reference: LogitsReference, logits_of_plan: Callable[[LayerPlan], LogitsOfRows],
                  plans: Sequence[LayerPlan], model_name: str, num_layers: int,
                  on_progress: Callable[[int, int], None] | None = None,
                  journal: RowJournal | None = None) -> ExploreResult:
    """Each plan's perplexity, KL and top-1 agreement against the reference (the full model's
    distributions on the ids), its logits from logits_of_plan(plan), and the compute it adds.
    journal: where finished rows are kept, and taken from where an interrupted run of this grid
    (the same model, ids and reference perplexity) left them."""
    start = time.perf_counter()
    result = ExploreResult(model_name, int(reference.ids.size), reference.perplexity)
    finished: dict[str, ExploreRow] = {}
    if journal is not None:
        header = {"model": model_name, "tokens": result.tokens, "ids": ids_digest(reference.ids.ravel().tolist()),
                  "base_perplexity": repr(reference.perplexity)}
        for row in journal.open(header):
            try:
                finished[row["plan"]] = ExploreRow(**row)
            except (TypeError, KeyError):
                continue
    for done, plan in enumerate(plans, 1):
        name = plan.to_string()
        if name in finished:
            result.rows.append(finished[name])
            result.resumed += 1
        else:
            metrics = reference.divergence(logits_of_plan(plan))
            result.rows.append(ExploreRow(name, len(plan.active_steps), len(plan.active_steps) / num_layers - 1.0,
                                          metrics.perplexity, metrics.kl, metrics.top1_agreement))
            if journal is not None:
                journal.record(asdict(result.rows[-1]))
        if on_progress:
            on_progress(done, len(plans))
    result.seconds = time.perf_counter() - start
    return result
