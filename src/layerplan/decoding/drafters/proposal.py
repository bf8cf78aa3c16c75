"""What a drafter sees and returns, and the protocols drafters follow, without torch (the light
front end's lookup drafts, lite/, take them too).

A drafter sees a `DraftState` (the context, whose last token is *pending*: chosen but not yet run
through the target, and the target's KV cache) and returns a `Proposal`: tokens, and the
distributions q they were drawn from (numpy, after the same logits processing as the target's p),
or None for deterministic proposals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.tree import TreeShape
from layerplan.plan.plan import LayerPlan


class DraftPasses(Protocol):
    """A model's passes as a self-draft runs them (drafters/plan.py): the light front end's
    LiteModel, the torch front end's engine/runner.py ModelPasses."""

    def draft_logits(self, token: int, position: int, plan: LayerPlan, cache, draft_head=None) -> Any:
        """The logits (V,) of `token` at `position` through `plan` (a draft of the plan `cache`
        was made for: the slots of the steps it runs are written there, as the verify pass
        writes them again), read by draft_head (the draft's residual stream -> logits; a torch
        function) or, None, by the model's own final norm and LM head."""


@dataclass
class DraftState:
    model: Any  # the target's model (models/loading.py LoadedModel, or lite/model.py LiteModel)
    target: LayerPlan
    cache: Any  # the target's cache; self-drafts write the slots of the steps they run
    tokens: list[int]  # the context; tokens[-1] is pending (its KV is not in the cache yet)
    sampling: SamplingParams
    generator: np.random.Generator | None = None  # the request's draws (decoding/choice.py)
    output_from: int = 0  # tokens[output_from:] were generated (the presence and frequency penalties')
    passes: DraftPasses | None = None  # the target's passes, for the drafts that run its own plans


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: np.ndarray | None = None  # (len(tokens), V) draft distributions q; None = deterministic
    source: str | None = None  # which drafter made it, where one drafter picks among several (stats)
    # the tokens are the nodes of this tree (parent -1: the pending token), likeliest child first;
    # None: a chain
    tree: TreeShape | None = None

    def first_chain(self) -> Proposal:
        """The path through every node's first child: the proposal as a chain."""
        if self.tree is None:
            return self
        nodes, node = [], -1
        while children := self.tree.children(node):
            node = children[0]
            nodes.append(node)
        probs = self.probs[nodes] if self.probs is not None else None
        return Proposal([self.tokens[i] for i in nodes], probs, self.source)


@dataclass(frozen=True)
class RoundOutcome:
    """What one speculative round did, for a drafter that learns from it (`LearnsFromRounds`)."""

    source: str | None  # the proposal's source; None when nothing was drafted (a plain step)
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float  # the target pass over the pending token and the drafts


class Drafter(Protocol):
    name: str

    def check(self, model, target: LayerPlan) -> None:
        """Raise (PlanError / ValueError, saying why) unless this drafter can draft for `target`
        on `model`: before the first token, not halfway through a generation."""

    def propose(self, state: DraftState, max_tokens: int) -> Proposal: ...


@runtime_checkable
class LearnsFromRounds(Protocol):
    """A drafter that picks its own draft length (up to `max_draft`, or the draft-length policy's
    γ when one is given) and learns from each round's outcome (drafters/arbiter.py)."""

    max_draft: int

    def observe(self, outcome: RoundOutcome) -> None: ...
