"""What every drafter shares: the state it sees, the proposal it returns, the protocol, and the
token-by-token draft loop of the drafters that run a model.

A drafter sees a `DraftState` (the context, whose last token is *pending*: chosen but not yet run
through the target, and the target's KV cache) and returns a `Proposal`: tokens, and the
distributions q they were drawn from (after the same logits processing as the target's), or None
for deterministic proposals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from layerplan.decoding.sampling import argmax_token, draw_token, penalty_context, process_logits
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.cache import KVCache
from layerplan.engine.tree import TreeShape
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


@dataclass
class DraftState:
    model: LoadedModel
    target: LayerPlan
    cache: KVCache  # the target's cache; self-drafts write the slots of the steps they run
    tokens: list[int]  # the context; tokens[-1] is pending (its KV is not in the cache yet)
    sampling: SamplingParams
    generator: np.random.Generator | None = None  # the request's draws (decoding/choice.py)
    output_from: int = 0  # tokens[output_from:] were generated (the presence and frequency penalties')


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # (len(tokens), V) draft distributions q; None = deterministic
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

    def check(self, model: LoadedModel, target: LayerPlan) -> None:
        """Raise (PlanError / ValueError, saying why) unless this drafter can draft for `target`
        on `model`: before the first token, not halfway through a generation."""

    def propose(self, state: DraftState, max_tokens: int) -> Proposal: ...


@runtime_checkable
class LearnsFromRounds(Protocol):
    """A drafter that picks its own draft length (up to `max_draft`, or the draft-length policy's
    γ when one is given) and learns from each round's outcome (drafters/arbiter.py)."""

    max_draft: int

    def observe(self, outcome: RoundOutcome) -> None: ...


def draft_token(logits: torch.Tensor, state: DraftState, seen: list[int]) -> tuple[int, torch.Tensor, float]:
    """(token, q, top-1 probability) from one position's draft logits (V,)."""
    params = state.sampling
    processed = process_logits(logits, params, penalty_context(seen, params, state.output_from))
    if params.greedy:
        token = argmax_token(processed)
        confidence = float(torch.softmax(processed, -1)[token])
        q = torch.zeros_like(processed)
        q[token] = 1.0
        return token, q, confidence
    q = torch.softmax(processed, -1)
    token = draw_token(q, state.generator)
    return token, q, float(q.max())


class AutoregressiveDrafter:
    """Drafts token by token with some forward function; stops early on low confidence."""

    name = "autoregressive"
    min_confidence: float = 0.0  # stop drafting when the draft's top-1 probability falls below this
    # greedy only: where the top-1 probability is below this, the runner-up joins as a sibling leaf
    # (SWIFT-style width), so the round checks a token tree; 0 = a chain
    branch_below: float = 0.0

    def _draft_loop(self, state: DraftState, max_tokens: int, step: Callable[[int, int], torch.Tensor]) -> Proposal:
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        parents: list[int] = []  # of each node, where a branch made a tree
        seen = list(state.tokens)
        position = len(state.tokens) - 1
        token = state.tokens[-1]
        branching = self.branch_below > 0 and state.sampling.greedy
        while len(tokens) < max_tokens:
            logits = step(token, position)
            token, q, confidence = draft_token(logits, state, seen)
            if tokens and confidence < self.min_confidence:
                break  # keep at least one token: an unsure guess still costs only one draft step
            parent = _last_chain_node(parents)
            tokens.append(token)
            probs.append(q)
            parents.append(parent)
            if branching and confidence < self.branch_below and len(tokens) < max_tokens:
                runner_up = int(logits.topk(2).indices[1])
                tokens.append(runner_up)
                probs.append(torch.nn.functional.one_hot(torch.tensor(runner_up), q.shape[-1]).to(q))
                parents.append(parent)
            seen.append(token)
            position += 1
        if any(parent != i - 1 for i, parent in enumerate(parents)):  # greedy drafts: one-hot q, deterministic
            return Proposal(tokens, None, tree=TreeShape(tuple(parents)))
        return Proposal(tokens, torch.stack(probs) if probs else None)


def _last_chain_node(parents: list[int]) -> int:
    """The latest node of the main chain (-1 before the first): the last node, unless it is a
    runner-up leaf, which is appended right after the chain node it sits beside."""
    last = len(parents) - 1
    if last >= 1 and parents[last] == parents[last - 1]:
        return last - 1
    return last
