"""The whole job in one call: scan, search a draft, benchmark it against plain decoding and
transformers (plain decoding alone on a GGUF run as stored: app/bench.py wants_transformers), check
exactness, keep the plan for the `auto` drafter, and draw the draft frontier. Printing and the
report's files live in the CLI and report."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerplan.app.bench import bench_methods
from layerplan.app.bench_runs import BenchResult, run_bench
from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS
from layerplan.decoding.drafters.saved import save_draft_plan
from layerplan.decoding.frontier import FrontierResult, measure_frontier, pass_costs_of, self_drafts
from layerplan.decoding.generate import decode_by, generate
from layerplan.engine.probe import time_passes
from layerplan.engine.probe_rows import ProbeRow
from layerplan.models.loading import LoadedModel
from layerplan.search.evaluate import calibration_ids
from layerplan.search.evaluator import PlanEvaluator, measure_costs
from layerplan.search.greedy import GreedyResult, greedy_search
from layerplan.search.objectives import score
from layerplan.search.importance import ScanJournal, ScanResult
from layerplan.search.scan import scan


@dataclass
class DraftChoice:
    draft: str
    speedup_median: float  # vs the bench's reference row (BenchResult.reference), median over prompts
    speedup_min: float
    speedup_max: float
    spread_ms: float  # largest spread (max − min ms/token) over the repeated timings of one prompt
    same_as_plain_bf16: bool  # every prompt's tokens equal layerplan's plain greedy in the bench dtype
    # greedy equality checked in float32 arithmetic (the exactness guarantee): transformers' float32
    # model, or a GGUF's blocks as stored with exact products (TuneResult.exact_precision)
    same_as_plain_fp32: bool


@dataclass
class TuneResult:
    model: str
    dtype: str
    scan: ScanResult
    greedy: GreedyResult
    predicted_speedup: float  # of the searched skip plan, from agreement and measured cost
    bench: BenchResult  # its cpu says which machine every timing here comes from
    choices: list[DraftChoice] = field(default_factory=list)
    best: DraftChoice | None = None
    saved_plan: str | None = None  # the skip plan kept for the `auto` drafter, if it was worth keeping
    saved_to: str | None = None  # where it was kept (decoding/drafters/registry.py save_draft_plan)
    # every family's acceptance against its draft cost, beside the break-even curve (frontier.py)
    frontier: FrontierResult | None = None
    exact_precision: str = "float32"  # the model the exactness check decoded with

    def to_dict(self) -> dict:
        return asdict(self)

    def command(self) -> str:
        draft = self.best.draft if self.best else "ngram"
        return f'layerplan generate --dtype {self.dtype} --draft "{draft}" "your prompt"'


def _stage(on_stage: Callable[[str], None] | None, text: str) -> None:
    if on_stage:
        on_stage(text)


def tune(
    model: LoadedModel,
    fp32_model: Callable[[], LoadedModel],
    prompts: dict[str, str] | None = None,
    tokens: int = 256,
    greedy_steps: int = 8,
    repeats: int = 3,
    new_tokens: int = 48,
    stock: LoadedModel | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    probe_row: ProbeRow | None = None,
    scan_journal: Path | None = None,
) -> TuneResult:
    """model: the model to decode with (the native engine, or packed bf16 linears); stock: the
    same weights as transformers runs them, for its generate (None: transformers is not timed, and
    the bench's reference is plain decoding); fp32_model: loads the model of the exactness check
    (float32 arithmetic: transformers' float32 model, or a GGUF's blocks with exact products);
    probe_row: this machine's probe row for `model` (engine/probe.py), the verify costs of its
    timed speculative decoding; scan_journal: where the scan keeps its finished candidates
    (search/importance.py ScanJournal: a tune started again after an interruption takes them; the
    caller removes it once the report is written). A searched skip plan that pays is kept
    for the `auto` drafter (save_draft_plan)."""
    prompts = prompts or {k: PROMPTS[k] for k in ("code", "summary")}
    ids = calibration_ids(model, tokens=tokens)
    _stage(on_stage, "scan: every attention and MLP switched off in turn")
    journal = ScanJournal(scan_journal, ids.flatten().tolist()) if scan_journal is not None else None
    scanned = scan(model, ids, kinds=["attention", "mlp"], on_progress=on_progress, journal=journal)
    _stage(on_stage, "search: greedy skip plan for predicted speculative speedup")
    costs = measure_costs(model)
    evaluator = PlanEvaluator(model, ids)
    greedy = greedy_search(evaluator, "speedup", budget=greedy_steps, costs=costs, on_progress=on_progress)
    best_step = greedy.best_step
    plan = model.plan(best_step.plan) if best_step is not None and best_step.value > 1.0 else None
    predicted = score("speedup", plan, evaluator, costs) if plan is not None else 1.0

    drafts = ["ngram", "suffix"] + ([plan.to_string(), f"ngram|{plan.to_string()}"] if plan is not None else [])
    against = " and transformers" if stock is not None else ""
    _stage(on_stage, f"bench: {', '.join(drafts)} against plain decoding{against}")
    methods = bench_methods(stock, model, drafts, probe_row=probe_row)
    bench = run_bench(stock or model, methods, prompts, new_tokens, repeats, on_progress=on_progress)

    exact = fp32_model()
    _stage(on_stage, f"exactness: greedy speculative == plain greedy in float32 ({exact.precision})")
    encoded = [exact.encode(p, chat=k in CHAT_PROMPTS) for k, p in prompts.items()]
    plain = [generate(exact, ids, max_new_tokens=new_tokens).token_ids for ids in encoded]
    choices = []
    for draft in drafts:
        rows = [r for r in bench.rows if r.method == f"layerplan draft={draft}"]
        speedups = [r.speedup for r in rows]
        same_fp32 = all(generate(exact, ids, max_new_tokens=new_tokens, draft=draft).token_ids == tokens
                        for ids, tokens in zip(encoded, plain))
        choices.append(DraftChoice(
            draft, statistics.median(speedups), min(speedups), max(speedups),
            max(max(r.samples_ms) - min(r.samples_ms) for r in rows),
            all(r.same_as_plain for r in rows), same_fp32,
        ))
    best = max(choices, key=lambda c: c.speedup_median)
    saved_to = save_draft_plan(model, plan) if plan is not None else None

    _stage(on_stage, "frontier: each draft family's acceptance against its cost, and the break-even curve")
    frontier = measure_frontier(model, decode_by(model),
                                self_drafts(model, plan.to_string() if plan is not None else None),
                                [model.encode(p, chat=k in CHAT_PROMPTS) for k, p in prompts.items()],
                                pass_costs_of(probe_row, model, time_passes),
                                new_tokens, cpu=bench.cpu.line(), on_progress=on_progress)
    return TuneResult(model.name, model.precision, scanned, greedy, predicted, bench,
                      choices, best, plan.to_string() if plan is not None else None,
                      str(saved_to) if saved_to is not None else None, frontier, exact.precision)
