"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the context's end."""

from __future__ import annotations

from layerplan.decoding.drafters.base import DraftState, Proposal
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


class NgramDrafter:
    """Prompt-lookup drafting: find the latest earlier occurrence of the context's last n tokens
    (n from max_n down to min_n) and propose what followed it. Costs no model call."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.name = "ngram" if (max_n, min_n) == (4, 1) else f"ngram:{max_n}"

    def check(self, model: LoadedModel, target: LayerPlan) -> None:
        pass  # text lookup fits any model and plan

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        tokens = state.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + max_tokens]
                    if follow:
                        return Proposal(list(follow), None)
        return Proposal()
