"""Self-speculation: the same model under a cheaper plan (skipped sub-layers, an early exit, a
windowed attention), sharing the target's KV cache step by step. Its passes are the model's
(proposal.py DraftPasses: the light front end's LiteModel, or the torch front end's ModelPasses), so
nothing here imports torch; a trained exit head is heads.py's ExitHeadDrafter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layerplan.decoding.drafters.base import AutoregressiveDrafter
from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.plan.plan import LayerPlan, PlanError

Head = Callable[[Any], Any]  # hidden (..., H) -> logits (..., V): a torch module or function (heads.py)


def named(base: str, head: Head | None) -> str:
    """A drafter's name with what its head adds ("exit:8" + a vocab=K head: "exit:8+vocab=K")."""
    label = getattr(head, "name", "")
    return f"{base}+{label}" if label else base


class PlanDrafter(AutoregressiveDrafter):
    """Self-speculation: the same model under a cheaper plan (skipped sub-layers, early exit),
    sharing the target's KV cache. The prompt always went through the full target.

    head: hidden -> logits for the draft (e.g. a ReducedHead, +vocab=K); None: the model's own
    final norm and LM head."""

    def __init__(self, plan: LayerPlan, min_confidence: float = 0.0, head: Head | None = None) -> None:
        self.plan = plan
        self.head = head
        self.name = named(plan.to_string(), head)
        self.min_confidence = min_confidence

    def check(self, model, target: LayerPlan) -> None:
        if not self.plan.is_draft_of(target):
            raise PlanError(
                f"draft plan '{self.plan}' is not a sub-plan of the target '{target}': a self-draft may only "
                "switch sub-layers off or exit early, so that both share the KV cache step by step"
            )
        if type(self) is PlanDrafter and self.head is None and self.plan.active_steps == target.active_steps:
            raise PlanError(f"draft plan '{self.plan}' runs every sub-layer the target '{target}' runs: drafting "
                            "with it costs as much as decoding and saves nothing; give a plan that skips layers "
                            "(skip:..., exit:E) or leave the draft out")

    def draft_head(self, model) -> Head | None:
        """What turns the draft's residual stream into logits: None, the model's own final norm
        and LM head (the passes' own, fused with the pass where they can)."""
        return self.head

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        passes, head = state.passes, self.draft_head(state.model)

        def step(token: int, position: int):
            return passes.draft_logits(token, position, self.plan, state.cache, head)

        return self._draft_loop(state, max_tokens, step)


class WindowedDrafter(PlanDrafter):
    """A self-draft that attends only to the first `sink` tokens and the `recent` latest ones
    (MagicDec / StreamingLLM style): at long context the draft's attention stops growing with
    the context, while the target still verifies against all of it."""

    def __init__(self, plan: LayerPlan, sink: int = 4, recent: int = 64, min_confidence: float = 0.0,
                 head: Head | None = None) -> None:
        if sink < 0 or recent < 1:
            raise ValueError(f"a draft window needs sink >= 0 and recent >= 1, got {sink}, {recent}")
        super().__init__(plan, min_confidence, head)
        self.window = (sink, recent)
        self.name = named(f"window:{sink},{recent}" + ("" if plan.is_identity else f"/{plan}"), head)

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        state.cache.read_window = self.window
        try:
            return super().propose(state, max_tokens)
        finally:
            state.cache.read_window = None
