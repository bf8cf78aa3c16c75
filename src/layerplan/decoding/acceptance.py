"""The speculative acceptance rule (Leviathan et al. 2023; Chen et al. 2023), as a pure function.

Vocabulary (as in vLLM's rejection sampler): each drafted token is **accepted** or rejected; at
the first rejection the target's correction is the **recovered** token, drawn from the residual
norm(max(0, p − q)); when every draft is accepted, one **bonus** token is drawn from the target's
next distribution. Either way a round emits accepted + 1 tokens, and the emitted sequence has
exactly the target's distribution.

Greedy decoding is the same rule on one-hot distributions: a draft is accepted iff it is the
target's argmax, and the recovered / bonus token is the argmax. A drafter that proposes tokens
without a distribution (n-gram lookup) counts as q = one-hot on its proposal, which is still exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from layerplan.decoding.choice import draw, seeded_generator
from layerplan.engine.tree import TreeShape


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafted tokens were accepted (a prefix of the draft)
    next_token: int  # the recovered token (after a rejection) or the bonus token (all accepted)
    bonus: bool  # True when every drafted token was accepted

    def emitted(self, draft: list[int]) -> list[int]:
        return draft[: self.accepted] + [self.next_token]


def accept_draft(
    draft: list[int],
    target_probs: np.ndarray,
    draft_probs: np.ndarray | None,
    generator: np.random.Generator | None = None,
) -> Verdict:
    """draft: γ proposed tokens. target_probs: (γ+1, V), p_i = the target's distribution for the
    position of draft[i] (the last row is for the bonus). draft_probs: (γ, V) q_i the proposals
    were drawn from, after the same logits processing as p; None means deterministic proposals.
    Both are taken as float64 arrays (anything numpy reads: a CPU tensor too). generator: the
    request's (decoding/choice.py seeded_generator; None: a fresh one)."""
    generator = generator if generator is not None else seeded_generator(None)
    target_probs = np.asarray(target_probs, dtype=np.float64)
    draft_probs = np.asarray(draft_probs, dtype=np.float64) if draft_probs is not None else None
    gamma = len(draft)
    if target_probs.shape[0] != gamma + 1:
        raise ValueError(f"need {gamma + 1} target distributions for {gamma} drafted tokens, got {target_probs.shape[0]}")
    for i, token in enumerate(draft):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        p_token = float(p[token])
        if q_token > 0 and p_token >= q_token:
            continue  # min(1, p/q) = 1: accepted without drawing
        if q_token > 0 and generator.random() * q_token < p_token:
            continue  # accepted with probability p/q
        if draft_probs is None:
            residual = p.copy()
            residual[token] = 0.0
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        return Verdict(i, _draw(residual, generator), bonus=False)
    return Verdict(gamma, _draw(target_probs[gamma], generator), bonus=True)


def accept_greedy(draft: list[int], picks: list[int]) -> Verdict:
    """accept_draft's verdict where the target decodes greedily, from its picks alone (picks[i]:
    the target's token for the position of draft[i], picks[-1] for the bonus): its p_i is one-hot
    at picks[i], so a drafted token stays while it is the pick, and the first one that is not is
    replaced by the pick, whatever the proposals' q (no randomness is used). It spares the γ+1
    vocabulary-wide distributions accept_draft takes, ~0.4 ms a round at a 49k vocabulary."""
    if len(picks) != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} target picks for {len(draft)} drafted tokens, got {len(picks)}")
    for i, token in enumerate(draft):
        if token != picks[i]:
            return Verdict(i, picks[i], bonus=False)
    return Verdict(len(draft), picks[-1], bonus=True)


def _draw(weights: np.ndarray, generator: np.random.Generator | None) -> int:
    """A token from unnormalised weights (V,); argmax when they are one-hot (greedy: no randomness used)."""
    total = float(weights.sum())
    if total <= 0:
        raise ValueError("the residual distribution is empty: target and draft distributions are inconsistent")
    top = int(weights.argmax())
    if float(weights[top]) == total:
        return top
    return draw(weights, generator)


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # the accepted nodes, root first (indices into the pass; node 0 is the pending token)
    next_token: int  # recovered (every child of the last accepted node rejected) or bonus (it had none)
    bonus: bool


def accept_tree(
    tree: TreeShape,
    tokens: Sequence[int],
    target_probs: Callable[[int], np.ndarray],
    generator: np.random.Generator | None = None,
) -> TreeVerdict:
    """The acceptance rule on a tree of deterministic proposals (SpecInfer's multi-draft rule with
    one-hot drafts). tree: the pass, node 0 the pending token; tokens[i]: node i's token;
    target_probs(i): the target's distribution (V,) for the token after node i.

    From the pending token down: the children of the current node are tried in order, each
    accepted with probability residual(token) / residual total, where the residual starts as the
    target's distribution and loses each rejected child's token. That is drawing from the target's
    distribution one candidate at a time, so every emitted token has exactly the target's
    distribution; when every child is rejected the recovered token comes from what is left. Greedy
    (one-hot distributions) draws nothing: a child is accepted iff it is the argmax."""
    generator = generator if generator is not None else seeded_generator(None)
    path: list[int] = []
    node = 0
    while True:
        residual = np.array(target_probs(node), dtype=np.float64)
        accepted = None
        for child in tree.children(node):
            token = tokens[child]
            total, weight = float(residual.sum()), float(residual[token])
            if weight > 0 and (weight >= total or generator.random() * total < weight):
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            return TreeVerdict(path, _draw(residual, generator), bonus=not tree.children(node))
        path.append(accepted)
        node = accepted


def accept_tree_greedy(tree: TreeShape, tokens: Sequence[int], pick_after: Callable[[int], int]) -> TreeVerdict:
    """accept_tree's verdict where the target decodes greedily, from its picks alone (pick_after(i):
    the target's token after node i): the one-hot distributions accept a child iff its token is
    the pick (the first such child, in order), and a node none of whose children is the pick ends
    the path with the pick (a bonus where it has no children). No vocabulary-wide distribution is
    built and no randomness used, as accept_greedy for a chain."""
    path: list[int] = []
    node = 0
    while True:
        chosen = pick_after(node)
        accepted = next((child for child in tree.children(node) if tokens[child] == chosen), None)
        if accepted is None:
            return TreeVerdict(path, chosen, bonus=not tree.children(node))
        path.append(accepted)
        node = accepted
