"""Lossless speculative decoding over decoding/loop.py's model protocol, without torch: draft a few
tokens cheaply, verify them in one target pass.

Per round (the pending token is chosen but not yet run through the target):

    draft   : the drafter proposes up to γ tokens d1..dγ (self-drafts write their own KV slots)
    verify  : the target runs [pending, d1..dγ] at once → p0..pγ (and writes every slot)
    accept  : acceptance.py keeps d1..dn and adds a recovered or bonus token
    rollback: the cache is cropped to the verified prefix; the new token becomes pending

`SpeculativeRounds` is that round on a DecodeLoop: the light front end's `SpeculativeLoop` (a
lookup drafter on a LiteModel), and the torch front end's speculative.py SpeculativeDecoding,
which adds token trees and batched passes. The verdicts are taken on numpy rows, the logits
processed by decoding/choice.py as a plain step's are: greedy output equals plain greedy output
token for token; sampled output has the target's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from layerplan.decoding.acceptance import Verdict, accept_draft, accept_greedy
from layerplan.decoding.choice import probabilities, processed_logits
from layerplan.decoding.draft_length import SEEDED_DRAFT_LENGTH, FixedLength, SharedRounds, make_draft_length
from layerplan.decoding.drafters.proposal import (DraftPasses, DraftState, Drafter, LearnsFromRounds, Proposal,
                                                  RoundOutcome)
from layerplan.decoding.loop import DecodeLoop, Pace, TokenPasses
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.text import TokenKind
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


def numpy_rows(logits) -> np.ndarray:
    """A pass's logits as a numpy array (a torch tensor's brought to the CPU in float32)."""
    return logits if isinstance(logits, np.ndarray) else logits.detach().float().cpu().numpy()


def target_pick(row: np.ndarray, sampling: SamplingParams, context: Sequence[int], output_from: int) -> int:
    """A greedy target's token from its logits (V,) after `context` (tokens from output_from on
    generated): the first maximum, once the logit bias and penalties are applied (as a plain
    step's, decoding/loop.py)."""
    if not sampling.changes_greedy_choice:
        return int(row.argmax())
    return int(processed_logits(row, sampling, context, output_from).argmax())


def target_probs(row: np.ndarray, sampling: SamplingParams, context: Sequence[int], output_from: int) -> np.ndarray:
    """The distribution (V,) float64 a sampled target draws from after `context`: the softmax of
    the logits processed by decoding/choice.py (as a plain step's)."""
    return probabilities(processed_logits(row, sampling, context, output_from))


def chain_verdict(context: list[int], draft: list[int], draft_probs: np.ndarray | None, rows: np.ndarray,
                  sampling: SamplingParams, generator: np.random.Generator | None, output_from: int) -> Verdict:
    """The verdict on a chain of drafted tokens from the target's logits rows (γ+1, V): row i
    after context + draft[:i]. draft_probs: the drafts' q (γ, V), None for deterministic ones."""
    if sampling.greedy:  # the picks alone decide (accept_greedy)
        return accept_greedy(draft, [target_pick(rows[i], sampling, context + draft[:i], output_from)
                                     for i in range(len(draft) + 1)])
    probs = np.stack([target_probs(rows[i], sampling, context + draft[:i], output_from)
                      for i in range(len(draft) + 1)])
    return accept_draft(draft, probs, draft_probs, generator)


class VerifyPasses(TokenPasses, DraftPasses, Protocol):
    """The passes a speculative loop asks of a model besides TokenPasses' (and a self-draft's)."""

    def pass_logits(self, ids: Sequence[int], plan: LayerPlan, cache, start: int):
        """The logits (len(ids), vocab) of a pass of `ids` at positions start.. through `plan`,
        their keys and values written into `cache`."""


class SpeculativeRounds:
    """A DecodeLoop's steps as speculative rounds (a mixin: the loop's attributes are its state).
    start_rounds before the loop's own __init__ (the cache's spare rows are the drafts')."""

    def start_rounds(self, drafter: Drafter, draft_length, sampling: SamplingParams | None, seed: int | None,
                     pass_costs: dict[int, float], shared_rounds: SharedRounds | None) -> int:
        """Take the drafter and make the draft-length policy; the cache rows a round needs past
        the new tokens (the spare of DecodeLoop). pass_costs: k -> a k-token verify pass in steps
        on this machine (engine/probe.py), where known."""
        self.drafter = drafter
        self.learner = drafter if isinstance(drafter, LearnsFromRounds) else None
        if draft_length is None and self.learner is not None:
            draft_length = FixedLength(self.learner.max_draft)  # it picks its own length per round
        elif draft_length is None and seed is not None and sampling is not None and not sampling.greedy:
            # a seeded sample repeats itself: its draft lengths follow its own rounds alone (the
            # adaptive policy's follow this machine's timings and a server's other requests)
            draft_length = SEEDED_DRAFT_LENGTH
        self.lengths = make_draft_length(draft_length, pass_costs=pass_costs, shared=shared_rounds)
        self.stats = SpeculativeStats(drafter.name)
        max_gamma = getattr(self.lengths, "max_gamma", getattr(self.lengths, "gamma", 8))
        return max_gamma + 2

    def step(self) -> None:
        """The loop's step (decoding/loop.py): a round."""
        self.round()

    def round(self) -> None:
        """One round alone: draft, verify, accept, roll back."""
        gamma, proposal, t0, t1 = self.propose(None)
        drafted, emitted, accepted, bonus, rows = self.verify(gamma, proposal)
        self.record(gamma, drafted, accepted, emitted, bonus, rows, proposal, t0, t1, time.perf_counter())

    def verify(self, gamma: int, proposal: Proposal | None) -> tuple[int, list[int], int, bool, Sequence]:
        """The round's pass over the pending token and the proposal's first chain (up to γ
        tokens): (drafted, emitted, accepted, bonus, the logits rows of the emitted tokens)."""
        proposal = proposal.first_chain() if proposal is not None else None  # (its q rows the chain's)
        draft = proposal.tokens[:gamma] if proposal is not None else []
        position = len(self.context) - 1  # of the pending token
        logits = self.passes.pass_logits(self.context[-1:] + draft, self.plan, self.cache, position)
        emitted, accepted, bonus, rows = self.accept_chain(draft, proposal, logits)
        return len(draft), emitted, accepted, bonus, rows

    def propose(self, cap: int | None, others: int = 0) -> tuple[int, Proposal | None, float, float]:
        """The drafter's proposal of at most γ tokens (the policy's, within the budget left and
        `cap`), weighed by a pass that carries `others` rows of other requests; its timing."""
        left = self.out.max_new_tokens - len(self.out.tokens) - 1
        gamma = min(self.lengths.next_gamma(others), left)
        alone = getattr(self.lengths, "best_gamma", None)
        if others and gamma < left and alone is not None and gamma < alone(0):
            self.stats.busy_rounds += 1  # the pass's other rows made drafting cost more
        if cap is not None and cap < gamma:
            gamma = cap
            self.stats.capped_rounds += 1
        t0 = time.perf_counter()
        state = DraftState(self.model, self.plan, self.cache, self.context, self.sampling, self.draws,
                           output_from=len(self.prompt), passes=self.passes)
        proposal = self.drafter.propose(state, gamma) if gamma > 0 else None
        return gamma, proposal, t0, time.perf_counter()

    def accept_chain(self, draft: list[int], proposal: Proposal | None,
                     logits) -> tuple[list[int], int, bool, Sequence]:
        """A chain's verdict from its verify logits (γ+1, V) (proposal: a chain, its q rows the
        draft's), and the cache cropped to what stays:
        (emitted tokens, accepted drafts, bonus, the logits rows of the emitted tokens: row i is
        where the i-th was chosen, as the pass gave them)."""
        position = len(self.context) - 1
        draft_probs = proposal.probs[: len(draft)] if proposal is not None and proposal.probs is not None else None
        verdict = chain_verdict(self.context, draft, draft_probs, numpy_rows(logits), self.sampling, self.draws,
                                len(self.prompt))
        self.cache.crop(position + 1 + verdict.accepted)  # keep the pending token and the accepted drafts
        emitted = verdict.emitted(draft)
        return emitted, verdict.accepted, verdict.bonus, logits[:len(emitted)]

    def record(self, gamma: int, drafted: int, accepted: int, emitted: list[int], bonus: bool, rows,
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


class SpeculativeLoop(SpeculativeRounds, DecodeLoop):
    """decoding/loop.py's loop whose steps are speculative rounds of `drafter` (a drafter object,
    checked by its caller), the prompt through the full plan: the light front end's (a lookup
    drafter on a LiteModel, whose passes are VerifyPasses). Its other arguments are DecodeLoop's."""

    def __init__(self, model, ids: Sequence[int], plan: LayerPlan, drafter: Drafter, max_new_tokens: int,
                 stop: Sequence[str] = (), stop_at_eos: bool | Sequence[int] = True,
                 on_text: Callable[[str], None] | None = None, should_stop: Callable[[], bool] | None = None,
                 pace: Pace | None = None, cache=None, passes: VerifyPasses | None = None,
                 sampling: SamplingParams | None = None, seed: int | None = None, draft_length=None,
                 pass_costs: dict[int, float] | None = None, shared_rounds: SharedRounds | None = None) -> None:
        spare = self.start_rounds(drafter, draft_length, sampling, seed, dict(pass_costs or {}), shared_rounds)
        super().__init__(model, ids, plan, max_new_tokens, stop, stop_at_eos, on_text, should_stop, pace, spare,
                         cache, passes, sampling, seed)
