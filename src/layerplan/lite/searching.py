"""`layerplan search` on the light front end (a runner of lite/cli.py's kind, in a module of its
own: a search imports Optuna, which the other light commands must not wait for)."""

from __future__ import annotations

from collections.abc import Callable

from layerplan.corpus import given_text
from layerplan.lite.cli import ENDINGS, ended_by, load_for
from layerplan.lite.evaluator import LitePlanEvaluator, measure_lite_costs
from layerplan.lite.model import LiteModel
from layerplan.lite.research_request import LiteSearchRequest
from layerplan.lite.research import calibration_ids
from layerplan.search.bayes import check_storage, quiet_optuna
from layerplan.search.plan_search import SearchResult, check_method, search_plans


# the request's fields that are search_plans' options of the same name
_SEARCH_OPTIONS = ("objective", "method", "multi", "trials", "budget", "max_cost_cut", "granularity", "mode", "sampler",
                   "storage", "study_name", "allow_ends", "seed", "save_draft", "storage_patience")


def run_search(request: LiteSearchRequest, report: Callable[[SearchResult, LiteModel], None],
               on_stage: Callable[[str], None] | None = None,
               on_progress: Callable[[int, int], None] | None = None) -> int | None:
    """Carry out a runnable `layerplan search` request as app/cli/research.py's run_search_command
    would (the same calibration ids, scores and study: search/plan_search.py over
    lite/evaluator.py's evaluator, its costs measured on the kernels); report(result, model) prints
    and writes it (app/cli/searching.py report_search); on_stage / on_progress: its stages' bars.
    The exit status, or None where the model turned out to need the torch front end."""
    try:
        check_method(request.method, request.objective)
        if request.method != "greedy":
            check_storage(request.storage)
        calibration = given_text(request.text)
        model = load_for(request)
        ids = calibration_ids(model, calibration, request.tokens)
        if request.method != "greedy":
            quiet_optuna()
        options = {name: getattr(request, name) for name in _SEARCH_OPTIONS}
        result = search_plans(LitePlanEvaluator(model, ids), measure_costs=lambda: measure_lite_costs(model),
                              folder=request.out, on_stage=on_stage, on_progress=on_progress, **options)
        report(result, model)
    except ENDINGS as error:
        return ended_by(error)
    return 0
