"""`layerplan ppl`, `scan` and `explore` on the light front end (in a module of their own: a light
`generate` does not wait for the search modules' import), where they give what the torch front end
gives: ppl's JSON; a scan's or a grid's result, which the caller's report writes
(tests/test_lite_cli.py, tests/test_lite_research.py run both).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from layerplan.corpus import default_corpus, first_tokens, given_text, read_texts
from layerplan.lite.cli import ENDINGS, ended_by, load_for
from layerplan.lite.evaluator import LitePlanEvaluator, explore_lite
from layerplan.lite.model import LiteModel
from layerplan.lite.research_request import LiteExploreRequest, LitePerplexityRequest, LiteScanRequest
from layerplan.plan.plan import LayerPlan
from layerplan.search.explore import ExploreResult, explore_journal, grid_numbers, recompute_rewind_grid
from layerplan.search.importance import ScanJournal, ScanResult, check_kinds, journal_path, scan_plans
from layerplan.search.windows import added_bos, chunk_perplexity, logits_divergence, sliding_perplexity


def _bar(stage: str, unit: str) -> Callable[[int, int], None] | None:
    """On a terminal, a work's progress (stage: done of total unit) as one line on stderr, redrawn
    and gone once done (as the torch front end's bars); None elsewhere."""
    if not sys.stderr.isatty():
        return None

    def draw(done: int, total: int) -> None:
        line = f"\r{stage}: {done} of {total} {unit}\x1b[K" if done < total else "\r\x1b[K"
        print(line, end="", file=sys.stderr, flush=True)

    return draw


def run_ppl(request: LitePerplexityRequest) -> int | None:
    """Carry out a runnable `layerplan ppl` request as app/cli/research.py's run_ppl_command would:
    the same JSON, from the same logits through the same windows and sums (search/windows.py); the
    exit status, or None where the model turned out to need the torch front end."""
    try:
        texts = read_texts(request.text) if request.text else [default_corpus()]
        model = load_for(request)
        plan = model.plan(request.plan)
        sequences = [model.encode(text) for text in texts]
        if request.max_tokens:
            sequences = [ids[:request.max_tokens] for ids in sequences]

        def logits_of(tokens: list[int], under: LayerPlan = plan):
            return model.logits(tokens, model.new_cache(under, len(tokens)), 0, last_only=False)

        bar = _bar("perplexity", "windows")
        joined = [token for ids in sequences for token in ids]  # (the texts as one, as research.py's torch.cat)
        if request.protocol == "llama.cpp":  # one text, as llama-perplexity reads its file whole
            bos = added_bos(lambda text, special: model.tokenizer.encode(text, special_tokens=special))
            result = chunk_perplexity(joined, logits_of, request.window, bos, plan.to_string(), bar)
        else:
            result = sliding_perplexity(sequences, logits_of, request.window, request.stride, plan.to_string(), bar)
        report = result.to_dict()
        if request.compare and not plan.is_identity:  # (research.py's: the first min(window, 512) tokens)
            ids = joined[:min(request.window, 512)]
            report["vs_full_model"] = logits_divergence(logits_of(ids, model.plan(None))[None], logits_of(ids)[None],
                                                        [ids], plan.to_string()).to_dict()
    except ENDINGS as error:
        return ended_by(error)
    try:
        print(json.dumps(report, indent=2), flush=True)
    except BrokenPipeError:
        return 1
    return 0


def run_scan(request: LiteScanRequest, report: Callable[[ScanResult], None]) -> int | None:
    """Carry out a runnable `layerplan scan` request as app/cli/research.py's run_scan_command
    would (the same calibration ids, candidates and numbers: lite/evaluator.py); report(result)
    prints and writes it (app/cli/scoring.py report_scan). The exit status, or None where the
    model turned out to need the torch front end."""
    try:
        check_kinds(request.kinds)
        calibration = given_text(request.text)
        model = load_for(request)
        plan = model.plan(request.plan)
        ids = calibration_ids(model, calibration, request.tokens)
        evaluator = LitePlanEvaluator(model, ids, plan, reuse=request.reuse)
        journal = ScanJournal(journal_path(request.out, request.exits), ids)
        result = scan_plans(evaluator, request.kinds, _bar("scan", "candidates"), journal=journal)
        report(result)
        journal.remove()
    except ENDINGS as error:
        return ended_by(error)
    return 0


def run_explore(request: LiteExploreRequest, report: Callable[[ExploreResult], None]) -> int | None:
    """Carry out a runnable `layerplan explore` request (its grid of layer orders) as
    app/cli/research.py's run_explore_command would: the same ids, plans and numbers
    (search/explore.py over the same logits); report(result) prints and writes it
    (app/cli/exploring.py report_explore). The exit status, or None where the model turned out to
    need the torch front end."""
    try:
        numbers = [grid_numbers(name, value) for name, value in (("recompute", request.recompute),
                                                                  ("rewind", request.rewind))]
        calibration = given_text(request.text)
        model = load_for(request)
        candidates = recompute_rewind_grid(model, *numbers) + [model.plan(p) for p in request.plans]
        journal = explore_journal(request.out)
        result = explore_lite(model, calibration_ids(model, calibration, request.tokens), candidates,
                              _bar("explore", "plans"), journal)
        report(result)
        journal.remove()
    except ENDINGS as error:
        return ended_by(error)
    return 0


def calibration_ids(model: LiteModel, text: str | None, tokens: int) -> list[int]:
    """The first `tokens` ids of `text` (None: the built-in corpus), as search/evaluate.py's
    calibration_ids gives them on the torch front end."""
    return first_tokens(model.encode(text if text is not None else default_corpus()), tokens)
