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


class PlanEvaluator:
    """Quality of many plans against one reference plan (default: the full model) on fixed ids."""

    def __init__(self, model: LoadedModel, ids: torch.Tensor, reference: LayerPlan | None = None,
                 reuse: bool = True, probe_row: ProbeRow | None = None) -> None:
        self.model, self.ids = model, ids
        # this machine's probe row for the model: the verify costs of timed speculative decoding
        self.probe_row = probe_row
        self.reuse = reuse  # False: every candidate from the embeddings, no memo (the naive baseline)
        self.reference_plan = reference if reference is not None else model.plan()
        self.captured: dict[tuple[int, str], torch.Tensor] = {}
        with torch.inference_mode():
            hidden = run_hidden(model, ids, self.reference_plan,
                                observe=lambda i, sub, h: self.captured.__setitem__((i, sub), h))
            self.final_hidden = hidden  # (B, T, hidden): scoring the reference plan itself reads it
            self.reference = Reference.from_hidden(lambda h: head(model, h), hidden, ids)
        self.cache: dict[LayerPlan, Divergence] = {}
        self.evaluations = 0  # model runs actually made (memo hits excluded)
        self.aborted = 0  # of which stopped early because they could no longer matter

    def _resume_point(self, plan: LayerPlan) -> tuple[int, str] | None:
        """First (step, sub-layer) where `plan` differs from the reference; None if identical."""
        ref = self.reference_plan
        for i, step in enumerate(plan.active_steps):
            if i >= len(ref.active_steps):
                return 0, "attention"  # longer than the reference: nothing captured to resume from
            other = ref.steps[i]
            if step.layer != other.layer or step.scale != other.scale:
                return i, "attention"
            if step.attention != other.attention:
                return i, "attention"
            if step.mlp != other.mlp:
                return i, "mlp"
        if len(plan.active_steps) != len(ref.active_steps):
            return len(plan.active_steps), "attention"  # an earlier exit: resume at the exit
        return None

    @torch.inference_mode()
    def divergence(self, plan: LayerPlan, give_up=None) -> Divergence:
        """give_up: see Reference.divergence_of_hidden; an early-stopped result is not memoised."""
        if self.reuse and plan in self.cache:
            return self.cache[plan]
        point = self._resume_point(plan)
        if not self.reuse:
            hidden = run_hidden(self.model, self.ids, plan)
        elif point is None:  # the reference plan itself
            hidden = self.final_hidden
        elif point[0] >= len(plan.active_steps):  # nothing left to run: the exit point itself
            hidden = self.captured[(point[0], "attention")]
        else:
            hidden = run_hidden(self.model, None, plan, resume=Resume(self.captured[point], point[0], point[1]))
        self.evaluations += 1
        result = self.reference.divergence_of_hidden(lambda h: head(self.model, h), hidden, plan.to_string(),
                                                     give_up=give_up)
        if result.complete:
            self.cache[plan] = result
        else:
            self.aborted += 1
        return result
