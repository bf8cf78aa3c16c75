"""The layer-importance scan on the torch front end's model (search/importance.py is the scan:
its candidates, loop and result; here its evaluator, PlanEvaluator, and the routing shares of a
mixture-of-experts model, which read the routers' modules)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan
from layerplan.search.evaluator import PlanEvaluator
from layerplan.search.importance import KINDS, ScanJournal, ScanResult, check_kinds, scan_plans
from layerplan.search.routing import routing_shares


@torch.inference_mode()
def scan(
    model: LoadedModel,
    ids: torch.Tensor,
    plan: LayerPlan | None = None,
    kinds: Sequence[str] = KINDS,
    reuse: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
    journal: ScanJournal | None = None,
) -> ScanResult:
    """Switch off each active step's attention / MLP / both and compare with the base plan on ids (B, T)
    (journal: see scan_plans)."""
    check_kinds(kinds)
    plan = plan if plan is not None else model.plan()
    evaluator = PlanEvaluator(model, ids, reference=plan, reuse=reuse)
    return scan_plans(evaluator, kinds, on_progress, routing=routing_shares(model, ids, plan), journal=journal)
