"""The layer-plan draft a search or `layerplan tune` keeps for a model, which the `auto` drafter
weighs (decoding/drafters/registry.py): where it lives and how it is written. No torch: the light
front end's search keeps it too."""

from __future__ import annotations

from pathlib import Path

from layerplan.files import cache_dir
from layerplan.plan.formats import save_plan
from layerplan.plan.plan import LayerPlan


def saved_draft_path(model) -> Path:
    """Where the draft plan of a model (anything with the model's `name`) is kept."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.name)
    return cache_dir() / "plans" / f"{safe}.json"


def save_draft_plan(model, plan: LayerPlan) -> Path | None:
    """Keep `plan` as the layer-plan draft that `auto` weighs for this model (a search's or tune's
    best); its path, or None for the identity plan, which drafts nothing."""
    if plan.is_identity:
        return None
    path = saved_draft_path(model)
    save_plan(plan, path)
    return path
