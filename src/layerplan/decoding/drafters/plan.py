"""Self-speculation: the same model under a cheaper plan (skipped sub-layers, an early exit, a
trained exit head, a windowed attention), sharing the target's KV cache step by step."""

from __future__ import annotations

import torch

from layerplan.decoding.drafters.base import AutoregressiveDrafter
from layerplan.decoding.drafters.heads import ExitHead, Head, named
from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.engine.runner import head as final_head
from layerplan.engine.runner import run_hidden
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan, PlanError


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

    def check(self, model: LoadedModel, target: LayerPlan) -> None:
        if not self.plan.is_draft_of(target):
            raise PlanError(
                f"draft plan '{self.plan}' is not a sub-plan of the target '{target}': a self-draft may only "
                "switch sub-layers off or exit early, so that both share the KV cache step by step"
            )
        if type(self) is PlanDrafter and self.head is None and self.plan.active_steps == target.active_steps:
            raise PlanError(f"draft plan '{self.plan}' runs every sub-layer the target '{target}' runs: drafting "
                            "with it costs as much as decoding and saves nothing; give a plan that skips layers "
                            "(skip:..., exit:E) or leave the draft out")

    def _logits(self, model: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (1, 1, H) of the last position -> logits (V,)."""
        return (self.head(hidden) if self.head is not None else final_head(model, hidden))[0, -1]

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        device = state.model.device

        def step(token: int, position: int) -> torch.Tensor:
            ids = torch.tensor([[token]], device=device)
            return self._logits(state.model, run_hidden(state.model, ids, self.plan, state.cache, position)[:, -1:])

        return self._draft_loop(state, max_tokens, step)


class ExitHeadDrafter(PlanDrafter):
    """Early exit after E steps, read through a trained exit head (heads.ExitHead) before the
    LM head (the model's own, or `head`)."""

    def __init__(self, plan: LayerPlan, exit_head: ExitHead, min_confidence: float = 0.0,
                 head: Head | None = None) -> None:
        super().__init__(plan, min_confidence, head)
        self.exit_head = exit_head
        self.name = named(f"exit:{len(plan.active_steps)}+head", head)

    @torch.inference_mode()
    def _logits(self, model: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
        return super()._logits(model, self.exit_head(hidden))


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
