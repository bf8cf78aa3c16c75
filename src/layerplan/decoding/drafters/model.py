"""Classic speculative decoding: a separate small model that shares the tokenizer drafts (or the
target's own weights quantized again to fewer bits: `self:bits=`). It runs by its own passes (the
decode loop's TokenPasses: a LiteModel's own on the light front end, engine/runner.py's
ModelPasses on the torch one), so nothing here imports torch."""

from __future__ import annotations

from typing import Any, Protocol

from layerplan.decoding.drafters.base import AutoregressiveDrafter
from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.decoding.loop import TokenPasses
from layerplan.decoding.text import common_prefix
from layerplan.plan.plan import LayerPlan


class DraftModelPasses(TokenPasses, Protocol):
    """A draft model's passes: the decode loop's, and a cache with room for more positions."""

    def with_room(self, cache: Any, end: int) -> Any:
        """A cache holding `cache`'s positions with room for positions up to `end` (the same one
        where it grows by itself)."""


class ModelDrafter(AutoregressiveDrafter):
    """Classic speculative decoding with a separate small model that shares the tokenizer."""

    def __init__(self, model, passes: DraftModelPasses, min_confidence: float = 0.0, plan: LayerPlan | None = None,
                 name: str | None = None) -> None:
        """model: the draft model (models/loading.py LoadedModel or lite/model.py LiteModel), run
        by `passes`; plan: how it runs (its full plan by default); name: the spec it came from."""
        self.model, self.passes = model, passes
        self.plan = plan if plan is not None else model.plan()
        self.name = name or f"model:{model.name}"
        self.min_confidence = min_confidence
        self.cache = None
        self.fed: list[int] = []  # tokens whose KV is in self.cache, in order

    def check(self, model, target: LayerPlan) -> None:
        if self.model.vocab_size != model.vocab_size:
            raise ValueError(f"draft model vocabulary ({self.model.vocab_size}) differs from the target's "
                             f"({model.vocab_size})")

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        context = state.tokens
        end = len(context) + max_tokens
        if self.cache is None:
            self.cache = self.passes.new_cache(self.plan, end + 256)
        else:
            self.cache = self.passes.with_room(self.cache, end)
        common = common_prefix(self.fed, context[:-1])
        self.cache.crop(common)
        self.fed = self.fed[:common]
        if common < len(context) - 1:  # catch up on tokens the target accepted since last time
            # (only their keys and values are wanted: one row of the LM head, not one a token)
            self.passes.last_logits(context[common:-1], self.plan, self.cache, common)
            self.fed = list(context[:-1])

        def step(token: int, position: int):
            logits = self.passes.last_logits([token], self.plan, self.cache, position)
            self.fed.append(token)
            return logits

        return self._draft_loop(state, max_tokens, step)
