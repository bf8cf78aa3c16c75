"""layerplan: run a transformer language model's layers by plan."""

from layerplan.collection import collection_paused

with collection_paused():  # torch's and transformers' imports (layerplan/collection.py)
    from layerplan.engine.cache import KVCache
    from layerplan.models.loading import LoadedModel, ModelError, available_models
    from layerplan.engine.load import load_model, wrap_model  # after the architecture's check, with an engine
    from layerplan.plan.formats import load_plan
    from layerplan.plan.plan import LayerPlan, PlanError, Step, parse_plan

__all__ = [
    "KVCache",
    "LayerPlan",
    "LoadedModel",
    "ModelError",
    "PlanError",
    "Step",
    "available_models",
    "load_model",
    "load_plan",
    "parse_plan",
    "wrap_model",
]
__version__ = "0.1.0"
