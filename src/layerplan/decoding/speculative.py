"""Lossless speculative decoding: draft a few tokens cheaply, verify them in one target pass.

Per round (the pending token is chosen but not yet run through the target):

    draft   : the drafter proposes up to γ tokens d1..dγ (self-drafts write their own KV slots)
    verify  : the target runs [pending, d1..dγ] at once → p0..pγ (and writes every slot)
    accept  : accept_draft keeps d1..dn and adds a recovered or bonus token
    rollback: the cache is cropped to the verified prefix; the new token becomes pending

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
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from layerplan.decoding.acceptance import accept_draft, accept_greedy, accept_tree, accept_tree_greedy
from layerplan.decoding.draft_length import SEEDED_DRAFT_LENGTH, FixedLength, SharedRounds, make_draft_length
from layerplan.decoding.drafters.base import DraftState, Drafter, LearnsFromRounds, Proposal, RoundOutcome
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.text import GenerationResult, TokenKind
from layerplan.decoding.request import DecodeRequest
from layerplan.decoding.sampling import Seen, greedy_pick, next_token_probs, penalty_context
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.engine.cache import KVCache
from layerplan.engine.probe import ProbeRow
from layerplan.engine.runner import forward
from layerplan.engine.tree import TreeShape
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


@dataclass
class DrafterRounds:
    """The rounds one drafter drafted (where a drafter picks among several, e.g. --draft auto)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "tokens_per_pass": self.emitted / self.rounds if self.rounds else None}


@dataclass
class SpeculativeStats:
    drafter: str
    rounds: int = 0  # target passes after the prefill
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens produced by the rounds (accepted + recovered/bonus)
    plain_rounds: int = 0  # rounds with nothing drafted (a plain decoding step)
    # rounds whose draft length the batch's row budget cut (decoding/batch.py): a busy server
    # drafts less
    capped_rounds: int = 0
    # rounds drafted shorter (or not at all) because the batch's pass carried other requests' rows,
    # which make each drafted row cost more (draft_length.py AdaptiveLength.best_gamma)
    busy_rounds: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times drafted
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    gamma_history: list[int] = field(default_factory=list)
    by_drafter: dict[str, DrafterRounds] = field(default_factory=dict)  # rounds that drafted, per source

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass (1.0 is plain decoding)."""
        return self.emitted / self.rounds if self.rounds else float("nan")

    def record(self, gamma: int, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float,
               source: str | None = None) -> None:
        if drafted:
            part = self.by_drafter.setdefault(source or self.drafter, DrafterRounds())
            part.rounds += 1
            part.drafted += drafted
            part.accepted += accepted
            part.emitted += emitted
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.plain_rounds += drafted == 0
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        self.gamma_history.append(gamma)
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("gamma_history")
        data["by_drafter"] = {name: part.to_dict() for name, part in self.by_drafter.items()}
        data["acceptance_rate"] = self.acceptance_rate
        data["mean_accepted_length"] = self.mean_accepted_length
        data["per_position_acceptance"] = [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)]
        data["mean_gamma"] = sum(self.gamma_history) / len(self.gamma_history) if self.gamma_history else 0.0
        return data


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


class SpeculativeDecoding(DecodeRequest):
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
        target = plan if plan is not None else model.plan()
        costs = dict(probe_row.relative) if probe_row is not None else {}
        self.drafter = make_drafter(drafter, model, target, draft_confidence, costs)
        self.learner = self.drafter if isinstance(self.drafter, LearnsFromRounds) else None
        if draft_length is None and self.learner is not None:
            draft_length = FixedLength(self.learner.max_draft)  # it picks its own length per round
        elif draft_length is None and seed is not None and sampling is not None and not sampling.greedy:
            # a seeded sample repeats itself: its draft lengths follow its own rounds alone (the
            # adaptive policy's follow this machine's timings and a server's other requests)
            draft_length = SEEDED_DRAFT_LENGTH
        self.lengths = make_draft_length(draft_length, pass_costs=costs, shared=shared_rounds)
        max_gamma = getattr(self.lengths, "max_gamma", getattr(self.lengths, "gamma", 8))
        super().__init__(model, prompt, target, max_new_tokens, sampling, seed, stop, stop_at_eos, chat, on_text,
                         should_stop, probe_row, spare=max_gamma + 2, cache=cache)
        self.target = target  # the prompt prefills through it: the full target, always (skipping layers on
        # the prompt ruins acceptance)
        self.max_new_tokens = max_new_tokens
        self.stats = SpeculativeStats(self.drafter.name)
        self.trees = not any(layer.sliding_window for layer in model.parts.layers)  # a tree pass needs full attention
        self._round: tuple | None = None  # (gamma, draft, proposal, t0, t1) of the round whose pass is out

    def _propose(self, cap: int | None, others: int = 0) -> tuple[int, Proposal | None, float, float]:
        left = self.max_new_tokens - len(self.out.tokens) - 1
        gamma = min(self.lengths.next_gamma(others), left)
        alone = getattr(self.lengths, "best_gamma", None)
        if others and gamma < left and alone is not None and gamma < alone(0):
            self.stats.busy_rounds += 1  # the pass's other rows made drafting cost more
        if cap is not None and cap < gamma:
            gamma = cap
            self.stats.capped_rounds += 1
        t0 = time.perf_counter()
        state = DraftState(self.model, self.target, self.cache, self.context, self.sampling, self.draws,
                           output_from=len(self.prompt))
        proposal = self.drafter.propose(state, gamma) if gamma > 0 else None
        return gamma, proposal, t0, time.perf_counter()

    def step(self) -> None:
        """The loop's step (decoding/loop.py): a round."""
        self.round()

    def round(self) -> None:
        """One round alone: draft, verify (a chain, or a token tree), accept, roll back."""
        gamma, proposal, t0, t1 = self._propose(None)
        tree = proposal is not None and proposal.tree is not None
        if tree and not (self.trees and proposal.probs is None and len(proposal.tokens) <= gamma):
            proposal, tree = proposal.first_chain(), False
        if tree:
            drafted = len(proposal.tokens)
            emitted, accepted, bonus, rows = _verify_tree(self.model, self.target, self.cache, self.context,
                                                          proposal, self.sampling, self.draws, len(self.prompt))
        else:
            draft = proposal.tokens[:gamma] if proposal else []
            drafted = len(draft)
            emitted, accepted, bonus, rows = _verify_chain(self.model, self.target, self.cache, self.context, draft,
                                                           proposal, self.sampling, self.draws, len(self.prompt))
        self._record(gamma, drafted, accepted, emitted, bonus, rows, proposal, t0, t1, time.perf_counter())

    def next_pass(self, cap: int | None = None, others: int = 0) -> tuple[torch.Tensor, object, int]:
        """This request's part of a batch's pass: the pending token and a chain of at most `cap`
        drafted tokens (a tree goes as its first chain), its length weighed by what it adds to a
        pass that carries `others` rows for other requests; its cache, the pending token's
        position."""
        gamma, proposal, t0, t1 = self._propose(cap, others)
        if proposal is not None and proposal.tree is not None:
            proposal = proposal.first_chain()
        draft = proposal.tokens[:gamma] if proposal else []
        self._round = (gamma, draft, proposal, t0, t1)
        return torch.tensor([self.context[-1:] + draft], device=self.ids.device), self.cache, len(self.context) - 1

    def take_pass(self, logits: torch.Tensor) -> None:
        """The round's verify logits (1 + drafted, vocab) from the batch's pass: accept, roll back."""
        gamma, draft, proposal, t0, t1 = self._round
        emitted, accepted, bonus, rows = _accept_chain(self.cache, self.context, draft, proposal, logits,
                                                       self.sampling, self.draws, len(self.prompt))
        self._record(gamma, len(draft), accepted, emitted, bonus, rows, proposal, t0, t1, time.perf_counter())

    def _record(self, gamma: int, drafted: int, accepted: int, emitted: list[int], bonus: bool, rows,
                proposal: Proposal | None, t0: float, t1: float, t2: float) -> None:
        """rows: the target's logits each emitted token was chosen at (emit's)."""
        self.context.extend(emitted)  # the last one is the new pending token
        last: TokenKind = ("bonus" if bonus else "correction") if drafted else "plain"
        self.out.emit(emitted, ["accepted"] * accepted + [last], rows)
        source = (proposal.source or self.drafter.name) if drafted else None
        self.stats.record(gamma, drafted, accepted, len(emitted), t1 - t0, t2 - t1, source)
        self.pace.add(drafted + 1, t2 - t1)  # the verify pass: the pending token and the drafts
        if self.learner is not None:
            self.learner.observe(RoundOutcome(source, drafted, accepted, t1 - t0, t2 - t1))
        self.lengths.update(gamma, drafted, accepted, t1 - t0, t2 - t1)

    def result_stats(self) -> dict:
        return self.stats.to_dict()


def _verify_chain(model: LoadedModel, target: LayerPlan, cache, context: list[int], draft: list[int],
                  proposal: Proposal | None, sampling: SamplingParams, generator: np.random.Generator | None,
                  output_from: int = 0) -> tuple[list[int], int, bool, torch.Tensor]:
    """Check a chain of drafted tokens in one target pass (accept / recover / bonus). Returns the
    emitted tokens, how many drafted tokens were accepted, whether the last one is a bonus, and the
    logits each emitted token was chosen at (_accept_chain). context[output_from:] was generated."""
    position = len(context) - 1  # of the pending token
    verify_ids = torch.tensor([context[-1:] + draft], device=model.device)
    target_logits = forward(model, verify_ids, target, cache, position)[0]  # (γ+1, V)
    return _accept_chain(cache, context, draft, proposal, target_logits, sampling, generator, output_from)


def _accept_chain(cache, context: list[int], draft: list[int], proposal: Proposal | None, target_logits: torch.Tensor,
                  sampling: SamplingParams, generator: np.random.Generator | None,
                  output_from: int = 0) -> tuple[list[int], int, bool, torch.Tensor]:
    """A chain's verdict from its verify logits (γ+1, V), and the cache cropped to what stays:
    (emitted tokens, accepted drafts, bonus, the logits rows of the emitted tokens: row i is where
    the i-th was chosen). context[output_from:] was generated (the penalties')."""
    position = len(context) - 1
    seen = [penalty_context(context + draft[:i], sampling, output_from)
            for i in range(len(draft) + 1)]
    if sampling.greedy:  # the picks alone decide (accept_greedy)
        verdict = accept_greedy(draft, [greedy_pick(target_logits[i], sampling, seen[i]) for i in range(len(draft) + 1)])
    else:
        target_probs = torch.stack([next_token_probs(target_logits[i], sampling, seen[i]) for i in range(len(draft) + 1)])
        draft_probs = proposal.probs[: len(draft)] if proposal is not None and proposal.probs is not None else None
        verdict = accept_draft(draft, target_probs, draft_probs, generator)
    cache.crop(position + 1 + verdict.accepted)  # keep the pending token and the accepted drafts
    emitted = verdict.emitted(draft)
    return emitted, verdict.accepted, verdict.bonus, target_logits[:len(emitted)]


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

    def seen(node: int) -> Seen | None:  # the context and the node's path, for penalties
        return penalty_context(context + [tokens[i] for i in shape.path(node)[1:]], sampling,
                               output_from)

    if sampling.greedy:  # the picks alone decide (accept_tree_greedy)
        verdict = accept_tree_greedy(shape, tokens, lambda node: greedy_pick(logits[node], sampling, seen(node)))
    else:
        verdict = accept_tree(shape, tokens, lambda node: next_token_probs(logits[node], sampling, seen(node)),
                              generator)
    cache.keep_path(position, [0] + verdict.path)
    rows = [logits[node] for node in [0] + verdict.path]
    return [tokens[i] for i in verdict.path] + [verdict.next_token], len(verdict.path), verdict.bonus, rows

