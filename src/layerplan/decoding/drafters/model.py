"""Classic speculative decoding: a separate small model that shares the tokenizer drafts (or the
target's own weights quantized again to fewer bits: `self:bits=`)."""

from __future__ import annotations

import torch

from layerplan.decoding.drafters.base import AutoregressiveDrafter
from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.decoding.text import common_prefix
from layerplan.engine.cache import KVCache
from layerplan.engine.runner import forward, new_cache
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


class ModelDrafter(AutoregressiveDrafter):
    """Classic speculative decoding with a separate small model that shares the tokenizer."""

    def __init__(self, model: LoadedModel, min_confidence: float = 0.0, plan: LayerPlan | None = None,
                 name: str | None = None) -> None:
        """plan: how the draft model runs (its full plan by default); name: the spec it came from."""
        self.model = model
        self.plan = plan if plan is not None else model.plan()
        self.name = name or f"model:{model.name}"
        self.min_confidence = min_confidence
        self.cache: KVCache | None = None
        self.fed: list[int] = []  # tokens whose KV is in self.cache, in order

    def check(self, model: LoadedModel, target: LayerPlan) -> None:
        draft_vocab = self.model.hf.config.vocab_size
        target_vocab = model.hf.config.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"draft model vocabulary ({draft_vocab}) differs from the target's ({target_vocab})")

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        if self.cache is None:
            self.cache = new_cache(self.plan, capacity=len(state.tokens) + 256)
        context = state.tokens
        common = common_prefix(self.fed, context[:-1])
        self.cache.crop(common)
        self.fed = self.fed[:common]
        device = self.model.device
        if common < len(context) - 1:  # catch up on tokens the target accepted since last time
            ids = torch.tensor([context[common:-1]], device=device)
            # (only their keys and values are wanted: one row of the LM head, not one a token)
            forward(self.model, ids, self.plan, self.cache, common, last_only=True)
            self.fed = list(context[:-1])

        def step(token: int, position: int) -> torch.Tensor:
            ids = torch.tensor([[token]], device=device)
            logits = forward(self.model, ids, self.plan, self.cache, position, last_only=True)[0, -1]
            self.fed.append(token)
            return logits

        return self._draft_loop(state, max_tokens, step)
