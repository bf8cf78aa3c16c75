"""The torch front end's model under search/reference.py's evaluator (each candidate resumed from
the reference's residual stream at its first changed sub-layer, results memoised by plan) and its
decode costs (a cost model measured once). What a score means is in objectives.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from layerplan.engine.runner import Resume, embed, forward, head, new_cache, run_hidden
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.evaluate import Divergence, Reference
from layerplan.search.explore import ExploreResult, explore_plans
from layerplan.search.journal import RowJournal
from layerplan.search.reference import CostModel, LogitsReference, ResumingEvaluator, measured_costs


@torch.inference_mode()
def measure_costs(model: LoadedModel, context: int = 128, repeats: int = 12) -> CostModel:
    """search/reference.py measured_costs on the torch front end's model: decode steps after a
    context of `context` random tokens, and embeddings + LM head alone."""
    ids = torch.randint(0, model.hf.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    full = model.plan()

    def step(plan: LayerPlan) -> Callable[[], None]:
        cache = new_cache(full, capacity=context + 2)
        forward(model, ids[:, :context], full, cache, 0)

        def run() -> None:
            forward(model, ids[:, context:], plan, cache, context, last_only=True)
            cache.crop(context)

        return run

    return measured_costs(step, lambda: head(model, embed(model, ids[:, context:], context)), model.num_layers,
                          repeats)


class PlanEvaluator(ResumingEvaluator):
    """Quality of many plans against one reference plan (default: the full model) on fixed ids
    (B, T), on the torch front end's model (search/reference.py ResumingEvaluator)."""

    def __init__(self, model: LoadedModel, ids: torch.Tensor, reference: LayerPlan | None = None,
                 reuse: bool = True) -> None:
        super().__init__(reference if reference is not None else model.plan(), reuse)
        self.model, self.ids = model, ids
        self.name, self.tokens = model.name, int(ids.numel())
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


@torch.inference_mode()
def explore(model: LoadedModel, ids: torch.Tensor, plans: Sequence[LayerPlan],
            on_progress: Callable[[int, int], None] | None = None, journal: RowJournal | None = None) -> ExploreResult:
    """search/explore.py explore_plans on the torch front end's model: each plan's logits on ids
    (B, T) from the embeddings (journal: see explore_plans)."""
    def logits_of_plan(plan: LayerPlan | None):
        logits = forward(model, ids, plan)
        return lambda b, start, end: logits[b, start:end].float().cpu().numpy().copy()

    reference = LogitsReference(logits_of_plan(None), ids.cpu().numpy())
    return explore_plans(reference, logits_of_plan, plans, model.name, model.num_layers, on_progress, journal)
