"""The token-by-token draft loop of the drafters that run a model (AutoregressiveDrafter), and
how one position's draft logits become a drafted token and its q (numpy, after the same logits
processing as the target's p: decoding/choice.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from layerplan.decoding.choice import draw, probabilities, processed_logits
from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.decoding.rounds import numpy_rows
from layerplan.engine.tree import TreeShape


def draft_token(row: np.ndarray, state: DraftState, seen: list[int]) -> tuple[int, np.ndarray, float]:
    """(token, q, top-1 probability) from one position's draft logits (V,): q the processed
    logits' softmax in float64 (one-hot at the pick where greedy)."""
    params = state.sampling
    processed = processed_logits(row, params, seen, state.output_from)
    probs = probabilities(processed)
    if params.greedy:
        token = int(processed.argmax())
        q = np.zeros_like(probs)
        q[token] = 1.0
        return token, q, float(probs[token])
    return draw(probs, state.generator), probs, float(probs.max())


class AutoregressiveDrafter:
    """Drafts token by token with some forward function; stops early on low confidence."""

    name = "autoregressive"
    min_confidence: float = 0.0  # stop drafting when the draft's top-1 probability falls below this
    # greedy only: where the top-1 probability is below this, the runner-up joins as a sibling leaf
    # (SWIFT-style width), so the round checks a token tree; 0 = a chain
    branch_below: float = 0.0

    def _draft_loop(self, state: DraftState, max_tokens: int, step: Callable[[int, int], object]) -> Proposal:
        """step(token, position): the draft's logits (V,) after `token` at `position` (numpy, or a
        torch tensor, brought to the CPU here)."""
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        parents: list[int] = []  # of each node, where a branch made a tree
        seen = list(state.tokens)
        position = len(state.tokens) - 1
        token = state.tokens[-1]
        branching = self.branch_below > 0 and state.sampling.greedy
        while len(tokens) < max_tokens:
            row = numpy_rows(step(token, position))
            token, q, confidence = draft_token(row, state, seen)
            if tokens and confidence < self.min_confidence:
                break  # keep at least one token: an unsure guess still costs only one draft step
            parent = _last_chain_node(parents)
            tokens.append(token)
            probs.append(q)
            parents.append(parent)
            if branching and confidence < self.branch_below and len(tokens) < max_tokens:
                others = row.copy()
                others[token] = -np.inf
                runner_up = int(others.argmax())  # the row's best but the pick
                tokens.append(runner_up)
                probs.append(np.eye(1, len(q), runner_up)[0])
                parents.append(parent)
            seen.append(token)
            position += 1
        if any(parent != i - 1 for i, parent in enumerate(parents)):  # greedy drafts: one-hot q, deterministic
            return Proposal(tokens, None, tree=TreeShape(tuple(parents)))
        return Proposal(tokens, np.stack(probs) if probs else None)


def _last_chain_node(parents: list[int]) -> int:
    """The latest node of the main chain (-1 before the first): the last node, unless it is a
    runner-up leaf, which is appended right after the chain node it sits beside."""
    last = len(parents) - 1
    if last >= 1 and parents[last] == parents[last - 1]:
        return last - 1
    return last
