"""On-the-fly layer selection (`--draft online`): a self-draft whose skipped sub-layers are chosen
during decoding, with no offline search (in the spirit of SWIFT and CLaSp).

Every `every` rounds the drafter re-reads the last few verified tokens through the target with an
observer, as a pass of their own (no cache: the target's cache is not touched, so the output stays
exactly plain decoding's), which gives the residual stream before and after every sub-layer: the
verified text is free calibration data. A sub-layer that barely turns the stream (cosine similarity of before and after
near 1) is the cheapest to lose, so the draft skips the `n` most similar ones. `n` follows the
measured speed: after each window of rounds the drafter compares the tokens it produced per
second with the window before and keeps moving `n` the same way while that improves, else turns
back (a hill climb on measured time, so the cost of each sub-layer on this machine is in the
measure itself). Each round's proposal names its skip set as its source, so `--stats` shows how
the set evolved, with rounds, acceptance and tokens per pass per set.
"""

from __future__ import annotations

import torch

from layerplan.decoding.drafters.plan import PlanDrafter
from layerplan.decoding.drafters.proposal import DraftState, Proposal, RoundOutcome
from layerplan.engine.runner import run_hidden
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan, PlanError

SUB_LAYERS = ("attention", "mlp")


class OnlineSkipDrafter:
    def __init__(self, target: LayerPlan, min_confidence: float = 0.0, every: int = 8, calibration: int = 8,
                 start: float = 0.25, max_draft: int = 4) -> None:
        if every < 1 or calibration < 2 or not 0 < start < 1:
            raise ValueError(f"online drafting needs every >= 1, calibration >= 2 tokens and a start fraction in "
                             f"(0, 1); got every={every}, calibration={calibration}, start={start}")
        self.target, self.min_confidence = target, min_confidence
        self.every, self.calibration, self.max_draft = every, calibration, max_draft
        # (step index, sub-layer) of every switched-on sub-layer of the target
        self.sub_layers = [(i, kind) for i, step in enumerate(target.active_steps)
                           for kind in SUB_LAYERS if getattr(step, kind)]
        self.skip_count = max(1, round(start * len(self.sub_layers)))
        self.direction = 1
        self.ranking: list[tuple[int, str]] = []  # most skippable first
        self.draft: PlanDrafter | None = None
        self.rounds = 0
        self.window = [0, 0.0]  # tokens emitted, seconds spent in this window's rounds
        self.last_rate: float | None = None
        self.name = "online"

    def check(self, model: LoadedModel, target: LayerPlan) -> None:
        if len(self.sub_layers) < 2:
            raise PlanError("online layer selection needs a target with at least two switched-on sub-layers")

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        if self.draft is None or self.rounds % self.every == 0:
            self._recalibrate(state)
        proposal = self.draft.propose(state, max_tokens)
        proposal.source = f"online {self.draft.plan.to_string()}"
        return proposal

    def observe(self, outcome: RoundOutcome) -> None:
        self.rounds += 1
        self.window[0] += outcome.accepted + 1
        self.window[1] += outcome.draft_seconds + outcome.verify_seconds
        if self.rounds % self.every == 0 and self.window[1] > 0:
            rate = self.window[0] / self.window[1]
            if self.last_rate is not None and rate < self.last_rate:
                self.direction = -self.direction  # the last move made it slower: turn back
            self.last_rate = rate
            limit = max(1, len(self.sub_layers) - 1)
            self.skip_count = min(limit, max(1, self.skip_count + 2 * self.direction))
            self.window = [0, 0.0]

    def _recalibrate(self, state: DraftState) -> None:
        """Rank the sub-layers on the last verified tokens, then build the draft plan."""
        verified = len(state.tokens) - 1  # the pending token is not in the cache yet
        count = min(self.calibration, verified)
        if count >= 2:
            self.ranking = self._rank(state, verified - count, state.tokens[verified - count: verified])
        elif not self.ranking:
            self.ranking = list(reversed(self.sub_layers))  # no text yet: the deepest first
        skipped = self.ranking[: self.skip_count]
        plan = self.target
        for index, kind in skipped:
            plan = plan.with_step(index, **{kind: False})
        if self.draft is None or plan != self.draft.plan:
            self.draft = PlanDrafter(plan, self.min_confidence)

    def _rank(self, state: DraftState, start: int, tokens: list[int]) -> list[tuple[int, str]]:
        streams: list[torch.Tensor] = []

        def capture(step: int, sub_layer: str, hidden: torch.Tensor) -> None:
            streams.append(hidden[0].float())

        ids = torch.tensor([tokens], device=state.model.device)
        final = run_hidden(state.model, ids, self.target, None, start, observe=capture)
        streams.append(final[0].float())
        similarity = {}
        # the observer sees the stream before every sub-layer, switched off or not; pair each
        # switched-on one with the stream before the next
        order = [(i, kind) for i in range(len(self.target.active_steps)) for kind in SUB_LAYERS]
        for position, key in enumerate(order):
            if key in self.sub_layers:
                before, after = streams[position], streams[position + 1]
                similarity[key] = float(torch.nn.functional.cosine_similarity(before, after, dim=-1).mean())
        return sorted(self.sub_layers, key=lambda key: -similarity[key])
