"""Layer importance: switch off each step's attention, MLP or both in turn (or exit after each
step) and measure the damage against the base plan: the scan's candidates, its loop and its result.
No torch: the evaluator carries the front end (search/evaluator.py's PlanEvaluator on torch's
model, lite/evaluator.py's on the light one), and each candidate resumes from the base plan's
residual stream at its first switched-off sub-layer (identical up to there), so on average half
the model runs per candidate (`reuse=False` recomputes from the embeddings, the naive baseline).
For a mixture-of-experts model the result also holds each expert's routing share
(search/routing.py). A scan given a journal (ScanJournal, beside its outputs) keeps each finished
candidate there, so that the same scan started again after an interruption runs only the rest."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerplan.files import cache_dir, write_json_atomic
from layerplan.plan.plan import PlanError
from layerplan.search.journal import RowJournal, ids_digest
from layerplan.search.reference import ResumingEvaluator

KINDS = ("attention", "mlp", "layer")
EXIT = "exit"  # exit after `step` steps: the final norm and LM head on that residual stream


@dataclass(frozen=True)
class ScanItem:
    kind: str  # "attention", "mlp", "layer" (both), or "exit"
    step: int  # index of the plan step switched off (for "exit": steps run before the exit)
    layer: int  # the decoder layer that step runs (for "exit": the last layer run)
    perplexity: float
    perplexity_delta: float  # perplexity minus the base plan's
    kl: float  # mean KL(base || candidate) per token
    top1_agreement: float

    @property
    def label(self) -> str:
        """What is switched off, as a skip plan writes it (attn=3, mlp=9, layers=25) or exit:N."""
        if self.kind == "exit":
            return f"exit:{self.step}"
        return f"{ {'attention': 'attn', 'mlp': 'mlp', 'layer': 'layers'}[self.kind]}={self.layer}"


@dataclass
class ScanResult:
    model: str
    base_plan: str
    tokens: int
    base_perplexity: float
    items: list[ScanItem] = field(default_factory=list)
    seconds: float = 0.0
    reuse: bool = True
    # per plan step with a mixture-of-experts MLP: each expert's share of the top-k selections
    routing: list[ExpertRouting] = field(default_factory=list)
    resumed: int = 0  # candidates taken from an interrupted run's journal (ScanJournal), not run again

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ScanResult:
        """The result to_dict wrote (a KeyError or TypeError for a file that is not one)."""
        fields = {k: v for k, v in data.items() if k not in ("items", "routing")}
        return cls(**fields, items=[ScanItem(**item) for item in data["items"]],
                   routing=[ExpertRouting(**{**r, "shares": tuple(r["shares"])}) for r in data.get("routing", [])])

    def item(self, kind: str, layer: int) -> ScanItem | None:
        return next((i for i in self.items if i.kind == kind and i.layer == layer), None)

    def ranked(self, kind: str | None = None, key: str = "kl") -> list[ScanItem]:
        """Items (of one kind, or all), least harmful first by `key`."""
        return sorted((i for i in self.items if kind is None or i.kind == kind), key=lambda i: getattr(i, key))

    def table(self) -> str:
        lines = [f"{'layer':>5} {'kind':<9} {'ppl':>10} {'Δppl':>10} {'KL':>8} {'top1':>6}"]
        order = KINDS + (EXIT,)
        for item in sorted(self.items, key=lambda i: (i.layer, order.index(i.kind))):
            lines.append(
                f"{item.layer:>5} {item.kind:<9} {item.perplexity:>10.3f} {item.perplexity_delta:>+10.3f} "
                f"{item.kl:>8.4f} {item.top1_agreement:>6.3f}"
            )
        if self.routing:
            experts = len(self.routing[0].shares)
            lines += ["", f"expert routing share, % of top-k selections on the calibration text ({experts} experts)",
                      f"{'step':>5} {'layer':>5}  " + (" ".join(f"{f'e{e}':>5}" for e in range(experts))
                                                      if experts <= 16 else "")]
            lines += [f"{r.step:>5} {r.layer:>5}  {r.line()}" for r in self.routing]
        return "\n".join(lines)


def cached_scan_path(model_name: str) -> Path:
    """Where the latest sub-layer scan of a model is kept (`layerplan scan`, the server's page),
    so that a server finds it whatever folder it was started in."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return cache_dir() / "scans" / f"{safe}.json"


def save_cached_scan(result: ScanResult) -> Path:
    return write_json_atomic(cached_scan_path(result.model), result.to_dict())


def load_cached_scan(model_name: str) -> ScanResult | None:
    """The kept scan of the model; None when there is none or the file is not one (a scan is
    worth running again, not a reason to fail)."""
    try:
        result = ScanResult.from_dict(json.loads(cached_scan_path(model_name).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result if result.model == model_name else None


@dataclass(frozen=True)
class ExpertRouting:
    """One plan step's routing: share[e] = selections of expert e / all top-k selections (sums to
    1; a token routed to k experts counts k times)."""

    step: int
    layer: int
    selections: int  # tokens x top-k
    shares: tuple[float, ...]  # per expert

    def line(self) -> str:
        """The step's shares as a table row: every expert for up to 16, else the extremes."""
        shares = self.shares
        if len(shares) <= 16:
            return " ".join(f"{100 * s:5.1f}" for s in shares)
        order = sorted(range(len(shares)), key=lambda e: -shares[e])
        top = ", ".join(f"e{e} {100 * shares[e]:.1f}%" for e in order[:4])
        unused = sum(1 for s in shares if s == 0)
        return (f"{len(shares)} experts; most chosen {top}; least e{order[-1]} {100 * shares[order[-1]]:.2f}%; "
                f"never chosen {unused}")


class ScanJournal:
    """A scan's finished candidates in a RowJournal (search/journal.py) at `path`, beside the
    scan's outputs. Its header names the scan: the model, base plan, a digest of the calibration
    ids, reuse, and the base plan's perplexity (which another arithmetic or text changes).
    `remove` once the scan's outputs are written."""

    def __init__(self, path: str | os.PathLike, ids: Sequence[int]) -> None:
        self.path = Path(path)
        self.ids_digest = ids_digest(ids)
        self._journal = RowJournal(self.path)

    def open(self, result: ScanResult) -> dict[tuple[str, int], ScanItem]:
        """Start the journal for the scan `result` begins; the finished candidates of an earlier
        run of the same scan, by (kind, step)."""
        header = {"model": result.model, "base_plan": result.base_plan, "tokens": result.tokens,
                  "ids": self.ids_digest, "reuse": result.reuse, "base_perplexity": repr(result.base_perplexity)}
        found: dict[tuple[str, int], ScanItem] = {}
        for row in self._journal.open(header):
            try:
                item = ScanItem(**row)
            except TypeError:
                continue
            found[(item.kind, item.step)] = item
        return found

    def record(self, item: ScanItem) -> None:
        self._journal.record(asdict(item))

    def remove(self) -> None:
        self._journal.remove()


def journal_path(out: str | os.PathLike, exits: bool) -> Path:
    """Where `layerplan scan --out OUT` keeps its journal: beside scan.json (exits.json)."""
    return Path(out) / f"{'exits' if exits else 'scan'}.partial.jsonl"


def check_kinds(kinds: Sequence[str]) -> None:
    unknown = set(kinds) - set(KINDS) - {EXIT}
    if unknown:
        raise ValueError(f"unknown scan kind(s) {sorted(unknown)}; choose from {', '.join(KINDS + (EXIT,))}")


def scan_plans(evaluator: ResumingEvaluator, kinds: Sequence[str] = KINDS,
               on_progress: Callable[[int, int], None] | None = None,
               routing: Sequence[ExpertRouting] = (), journal: ScanJournal | None = None) -> ScanResult:
    """Switch off each active step's attention / MLP / both (and/or exit after each step) of the
    evaluator's reference plan, and score each candidate against it; journal: where finished
    candidates are kept, and taken from where an interrupted run of this scan left them."""
    check_kinds(kinds)
    plan = evaluator.reference_plan
    start = time.perf_counter()
    base = evaluator.reference.perplexity
    result = ScanResult(evaluator.name, plan.to_string(), evaluator.tokens, base, reuse=evaluator.reuse,
                        routing=list(routing))

    candidates = []
    for index, step in enumerate(plan.active_steps):
        for kind in (k for k in kinds if k != EXIT):
            off_attention = kind in ("attention", "layer")
            off_mlp = kind in ("mlp", "layer")
            if (off_attention and not step.attention) or (off_mlp and not step.mlp):
                continue  # already off in the base plan: nothing to measure
            candidates.append((index, step.layer, kind, off_attention, off_mlp))

    if EXIT in kinds:  # the logit lens: every earlier exit point of the plan
        candidates += [(steps, plan.active_steps[steps - 1].layer, EXIT, False, False)
                       for steps in range(1, len(plan.active_steps))]

    finished = journal.open(result) if journal is not None else {}
    for done, (index, layer, kind, off_attention, off_mlp) in enumerate(candidates, 1):
        if (kind, index) in finished:
            result.items.append(finished[(kind, index)])
            result.resumed += 1
            if on_progress:
                on_progress(done, len(candidates))
            continue
        try:
            if kind == EXIT:
                candidate = plan.with_exit(index)
            else:
                candidate = plan.with_step(
                    index, attention=False if off_attention else None, mlp=False if off_mlp else None
                )
        except PlanError:
            continue  # switching this off would leave nothing running
        metrics = evaluator.divergence(candidate)
        result.items.append(
            ScanItem(kind, index, layer, metrics.perplexity, metrics.perplexity - base, metrics.kl,
                     metrics.top1_agreement)
        )
        if journal is not None:
            journal.record(result.items[-1])
        if on_progress:
            on_progress(done, len(candidates))
    result.seconds = time.perf_counter() - start
    return result
