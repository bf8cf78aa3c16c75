"""layerplan: run a transformer language model's layers by plan.

The public names below load on first use (PEP 562), so that a process which needs none of them —
`layerplan generate` on a GGUF through the light front end (layerplan/lite/) — starts without
importing torch or transformers.
"""

from importlib import import_module

from layerplan.collection import collection_paused

# public name -> the module that defines it
_PUBLIC = {
    "KVCache": "layerplan.engine.cache",
    "LayerPlan": "layerplan.plan.plan",
    "LoadedModel": "layerplan.models.loading",
    "ModelError": "layerplan.models.errors",
    "PlanError": "layerplan.plan.plan",
    "Step": "layerplan.plan.plan",
    "available_models": "layerplan.models.loading",
    "load_model": "layerplan.engine.load",  # after the architecture's check, with an engine
    "load_plan": "layerplan.plan.formats",
    "parse_plan": "layerplan.plan.plan",
    "wrap_model": "layerplan.engine.load",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'layerplan' has no attribute '{name}'")
    with collection_paused():  # torch's and transformers' imports (layerplan/collection.py)
        value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_PUBLIC))
