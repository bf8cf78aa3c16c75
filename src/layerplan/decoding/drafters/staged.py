"""Several drafters in order of cost: the first one with a proposal drafts the round."""

from __future__ import annotations

from layerplan.decoding.drafters.proposal import DraftState, Drafter, Proposal
from layerplan.plan.plan import LayerPlan


class StagedDrafter:
    """Several drafters in order of cost: the first one with a proposal drafts this round
    (e.g. free n-gram lookup first, a layer-plan draft when the lookup finds nothing)."""

    def __init__(self, drafters: list[Drafter]) -> None:
        self.drafters = drafters
        self.name = "|".join(d.name for d in drafters)

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        for drafter in self.drafters:
            proposal = drafter.propose(state, max_tokens)
            if proposal.tokens:
                proposal.source = proposal.source or drafter.name
                return proposal
        return Proposal()

    def check(self, model, target: LayerPlan) -> None:
        for drafter in self.drafters:
            drafter.check(model, target)
