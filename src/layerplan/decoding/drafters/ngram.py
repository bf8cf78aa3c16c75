"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the context's end."""

from __future__ import annotations

from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.plan.plan import LayerPlan


class NgramDrafter:
    """Prompt-lookup drafting: find the latest earlier occurrence of the context's last n tokens
    (n from max_n down to min_n) and propose what followed it. Costs no model call: the n-grams
    are indexed as the context grows (a dict per n: n-gram -> its latest start whose n-gram has a
    token after it), so a round looks up at most max_n keys instead of scanning the context."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.name = "ngram" if (max_n, min_n) == (4, 1) else f"ngram:{max_n}"
        self._reset()

    def _reset(self) -> None:
        self.fed: list[int] = []  # the context indexed so far
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_n + 1)]

    def check(self, model, target: LayerPlan) -> None:
        pass  # text lookup fits any model and plan

    def _sync(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the context's last token (those with a token after
        them); start over on a context that does not extend the one indexed (a new request)."""
        fed = self.fed
        if len(tokens) < len(fed) or tokens[: len(fed)] != fed:
            self._reset()
            fed = self.fed
        for end in range(max(0, len(fed) - 1), len(tokens) - 1):  # the n-grams ending at `end`
            for n in range(1, min(self.max_n, end + 1) + 1):
                self.latest[n][tuple(tokens[end - n + 1: end + 1])] = end - n + 1
        self.fed = list(tokens)

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        tokens = state.tokens
        self._sync(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.latest[n].get(tuple(tokens[-n:]))
            if start is not None:
                return Proposal(list(tokens[start + n: start + n + max_tokens]), None)
        return Proposal()
