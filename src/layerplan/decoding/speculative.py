"""Lossless speculative decoding on the torch front end's model: decoding/rounds.py's rounds on
a DecodeRequest, with the drafters of every kind (drafters/registry.py), token trees, and a round's
verify pass shared with other requests (decoding/batch.py).

A drafter may propose a token tree (several continuations): the target checks every node in the
same pass (engine/tree.py) and `accept_tree` walks down from the pending token (greedy: the path of
target picks; sampling: SpecInfer's multi-draft rule, exact for the deterministic trees drafters
make); the cache keeps the accepted path only. A tree with draft distributions is checked as its
first chain.

The prompt always goes through the full target (skipping layers on it ruins acceptance). Greedy
output equals plain greedy output token for token; sampled output has the target's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from layerplan.decoding.acceptance import accept_tree, accept_tree_greedy
from layerplan.decoding.draft_length import SharedRounds
from layerplan.decoding.drafters.proposal import Drafter, Proposal
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.request import DecodeRequest
from layerplan.decoding.rounds import SpeculativeRounds, numpy_rows, target_pick, target_probs
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.text import GenerationResult
from layerplan.engine.cache import KVCache
from layerplan.engine.probe_rows import ProbeRow
from layerplan.engine.runner import forward
from layerplan.engine.tree import TreeShape
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


@torch.inference_mode()
def speculative_generate(
    model: LoadedModel,
    prompt: str | torch.Tensor | Sequence[int],
    drafter: Drafter | str,
    plan: LayerPlan | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_at_eos: bool | Sequence[int] = True,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    draft_length=None,
    draft_confidence: float = 0.0,
    should_stop: Callable[[], bool] | None = None,
    probe_row: ProbeRow | None = None,
) -> GenerationResult:
    """draft_confidence: a drafter that runs a model (every one but n-gram lookup) stops its round
    when its top-1 probability falls below this. probe_row: this machine's checked probe row for
    the model (see generate): the verify costs, and the pace the passes are compared with; None:
    the draft length and `auto` learn verify costs from the passes they see."""
    decoding = SpeculativeDecoding(model, prompt, drafter, plan, max_new_tokens, sampling, seed, stop, stop_at_eos,
                                   chat, on_text, draft_length, draft_confidence, should_stop, probe_row)
    return decoding.run()


class SpeculativeDecoding(SpeculativeRounds, DecodeRequest):
    """One request's speculative decode, a round at a time: the round alone (round()), or its
    verify pass given by whoever runs it, in a batch with other requests' (next_pass / take_pass:
    chains only, the draft length capped by the batch's row budget). cache: see DecodeRequest; a
    drafter given as an object keeps what it learned from earlier decodes (a conversation's).
    shared_rounds: what earlier and concurrent requests of the same drafter measured (a server's),
    where the draft length starts from (draft_length.SharedRounds)."""

    def __init__(self, model: LoadedModel, prompt, drafter: Drafter | str, plan: LayerPlan | None = None,
                 max_new_tokens: int = 64, sampling: SamplingParams | None = None, seed: int | None = None,
                 stop: Sequence[str] = (), stop_at_eos: bool | Sequence[int] = True, chat: bool = False,
                 on_text: Callable[[str], None] | None = None, draft_length=None, draft_confidence: float = 0.0,
                 should_stop: Callable[[], bool] | None = None, probe_row: ProbeRow | None = None,
                 cache: KVCache | None = None, shared_rounds: SharedRounds | None = None) -> None:
        # the prompt prefills through the target: the full one, always (skipping layers on the
        # prompt ruins acceptance)
        target = plan if plan is not None else model.plan()
        costs = dict(probe_row.relative) if probe_row is not None else {}
        spare = self.start_rounds(make_drafter(drafter, model, target, draft_confidence, costs), draft_length,
                                  sampling, seed, costs, shared_rounds)
        super().__init__(model, prompt, target, max_new_tokens, sampling, seed, stop, stop_at_eos, chat, on_text,
                         should_stop, probe_row, spare=spare, cache=cache)
        self.trees = not any(layer.sliding_window for layer in model.parts.layers)  # a tree pass needs full attention
        self._round: tuple | None = None  # (gamma, draft, proposal, t0, t1) of the round whose pass is out

    def verify(self, gamma: int, proposal: Proposal | None) -> tuple[int, list[int], int, bool, Sequence]:
        """A token tree in one pass where the model can (deterministic proposals, full attention),
        else the chain of rounds.py."""
        if not (proposal is not None and proposal.tree is not None and self.trees and proposal.probs is None
                and len(proposal.tokens) <= gamma):
            return super().verify(gamma, proposal)
        emitted, accepted, bonus, rows = _verify_tree(self.model, self.plan, self.cache, self.context, proposal,
                                                      self.sampling, self.draws, len(self.prompt))
        return len(proposal.tokens), emitted, accepted, bonus, rows

    def next_pass(self, cap: int | None = None, others: int = 0) -> tuple[torch.Tensor, object, int]:
        """This request's part of a batch's pass: the pending token and a chain of at most `cap`
        drafted tokens (a tree goes as its first chain), its length weighed by what it adds to a
        pass that carries `others` rows for other requests; its cache, the pending token's
        position."""
        gamma, proposal, t0, t1 = self.propose(cap, others)
        proposal = proposal.first_chain() if proposal is not None else None  # (its q rows the chain's)
        draft = proposal.tokens[:gamma] if proposal is not None else []
        self._round = (gamma, draft, proposal, t0, t1)
        return torch.tensor([self.context[-1:] + draft], device=self.ids.device), self.cache, len(self.context) - 1

    def take_pass(self, logits: torch.Tensor) -> None:
        """The round's verify logits (1 + drafted, vocab) from the batch's pass: accept, roll back."""
        gamma, draft, proposal, t0, t1 = self._round
        emitted, accepted, bonus, rows = self.accept_chain(draft, proposal, logits)
        self.record(gamma, len(draft), accepted, emitted, bonus, rows, proposal, t0, t1, time.perf_counter())


def _verify_tree(model: LoadedModel, target: LayerPlan, cache, context: list[int], proposal: Proposal,
                 sampling: SamplingParams, generator: np.random.Generator | None,
                 output_from: int = 0) -> tuple[list[int], int, bool, list]:
    """Check a token tree of deterministic proposals in one target pass. Returns the emitted tokens
    (the accepted path, then a recovered or bonus token), how many drafted tokens were accepted,
    whether the last one is a bonus, and the logits each emitted token was chosen at (the pending
    token's node, then the accepted path's)."""
    # the pass: the pending token as node 0, the drafted nodes after it
    shape = TreeShape((-1,) + tuple(parent + 1 for parent in proposal.tree.parents))
    tokens = context[-1:] + list(proposal.tokens)
    position = len(context) - 1
    logits = forward(model, torch.tensor([tokens], device=model.device), target, cache, position, tree=shape)[0]
    rows = numpy_rows(logits)

    def seen(node: int) -> list[int]:  # the context and the node's path, for penalties
        return context + [tokens[i] for i in shape.path(node)[1:]]

    if sampling.greedy:  # the picks alone decide (accept_tree_greedy)
        verdict = accept_tree_greedy(shape, tokens, lambda node: target_pick(rows[node], sampling, seen(node),
                                                                             output_from))
    else:
        verdict = accept_tree(shape, tokens, lambda node: target_probs(rows[node], sampling, seen(node), output_from),
                              generator)
    cache.keep_path(position, [0] + verdict.path)
    kept = [logits[node] for node in [0] + verdict.path]
    return [tokens[i] for i in verdict.path] + [verdict.next_token], len(verdict.path), verdict.bonus, kept
