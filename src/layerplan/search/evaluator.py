"""Scoring candidate plans fast: each candidate resumes from the full model's residual stream at
its first changed sub-layer (identical up to there), results are memoised by plan, and decode
cost comes from a cost model measured once. What a score means is in objectives.py."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from layerplan.engine.probe import ProbeRow
from layerplan.engine.runner import Resume, embed, forward, head, new_cache, run_hidden
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.evaluate import Divergence, Reference
from layerplan.search.reference import ResumingEvaluator


@dataclass(frozen=True)
class CostModel:
    """Seconds of one decode step, split into a fixed part (embeddings, LM head, overheads) and
    per-sub-layer averages, measured on the model in its dtype on this machine."""

    full_step: float
    fixed: float
    attention: float  # one attention sub-layer
    mlp: float  # one MLP sub-layer

    def relative_cost(self, plan: LayerPlan) -> float:
        """c: one decode step of `plan` divided by one step of the full model."""
        attention = sum(s.attention for s in plan.active_steps)
        mlp = sum(s.mlp for s in plan.active_steps)
        return (self.fixed + attention * self.attention + mlp * self.mlp) / self.full_step

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def measure_costs(model: LoadedModel, context: int = 128, repeats: int = 12) -> CostModel:
    """Median times of single-token decode steps: the full model, every attention off, every MLP
    off, and embeddings + LM head alone (the fixed part). The per-sub-layer parts are scaled so
    that the parts add up to the full step exactly (timings on a busy machine need not)."""
    n = model.num_layers
    full = model.plan()
    ids = torch.randint(0, model.hf.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)

    def median(run) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def step_time(plan: LayerPlan) -> float:
        cache = new_cache(full, capacity=context + 2)
        forward(model, ids[:, :context], full, cache, 0)

        def run():
            forward(model, ids[:, context:], plan, cache, context, last_only=True)
            cache.crop(context)

        return median(run)

    full_s = step_time(full)
    no_attention = step_time(LayerPlan.from_skips(n, attention=range(n)))
    no_mlp = step_time(LayerPlan.from_skips(n, mlp=range(n)))
    fixed = min(median(lambda: head(model, embed(model, ids[:, context:], context))), full_s)
    attention = max(full_s - no_attention, 1e-9)
    mlp = max(full_s - no_mlp, 1e-9)
    share = (full_s - fixed) / (attention + mlp)  # make fixed + all sub-layers == the full step
    return CostModel(full_s, fixed, attention * share / n, mlp * share / n)


class PlanEvaluator(ResumingEvaluator):
    """Quality of many plans against one reference plan (default: the full model) on fixed ids
    (B, T), on the torch front end's model (search/reference.py ResumingEvaluator)."""

    def __init__(self, model: LoadedModel, ids: torch.Tensor, reference: LayerPlan | None = None,
                 reuse: bool = True, probe_row: ProbeRow | None = None) -> None:
        super().__init__(reference if reference is not None else model.plan(), reuse)
        self.model, self.ids = model, ids
        self.name, self.tokens = model.name, int(ids.numel())
        # this machine's probe row for the model: the verify costs of timed speculative decoding
        self.probe_row = probe_row
        with torch.inference_mode():
            hidden = run_hidden(model, ids, self.reference_plan,
                                observe=lambda i, sub, h: self.captured.__setitem__((i, sub), h))
            self.final_hidden = hidden  # (B, T, hidden): scoring the reference plan itself reads it
            self.reference = Reference.from_hidden(lambda h: head(model, h), hidden, ids)

    @torch.inference_mode()
    def run(self, plan: LayerPlan, resume: tuple[int, str] | None) -> torch.Tensor:
        if resume is None:
            return run_hidden(self.model, self.ids, plan)
        return run_hidden(self.model, None, plan, resume=Resume(self.captured[resume], *resume))

    @torch.inference_mode()
    def score(self, hidden: torch.Tensor, plan: str, give_up) -> Divergence:
        return self.reference.divergence_of_hidden(lambda h: head(self.model, h), hidden, plan, give_up=give_up)
