"""The arbiter (`--draft auto`): per round, the drafter and draft length with the most expected
tokens per unit of time, or a plain step when no draft is expected to pay.

Two kinds of candidates:
- lookups (suffix, n-gram): nearly free and deterministic, so each is asked every round and judged
  on what it actually proposes (a lookup with no match is no candidate this round; one that could
  not pay even with a full-length proposal is not asked until its probe);
- model drafts (a saved skip plan): cost a fraction of a step per token, so the arbiter picks
  their γ before running them.

Each candidate's value is Leviathan et al.'s expected speedup (draft_length.expected_speedup):
expected tokens (1 − α^(γ+1)) / (1 − α) over the round's cost γ·c + V(γ+1), in plain steps.
α is the candidate's own per-token acceptance (exponentially decayed counts of accepted tokens and
rejections, from each round's outcome), c its measured seconds per draft token over a measured
plain step, V(k) the cost of a k-token verify pass: the probe's curve (engine/probe.py) when this
machine was probed, else learned from the verify passes seen (1 + (k − 1)·extra). A candidate not
chosen for `probe_every` rounds gets a one-token round, so that acceptance that recovers with the
text is noticed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from layerplan.decoding.draft_length import expected_speedup
from layerplan.decoding.drafters.base import DraftState, Drafter, Proposal, RoundOutcome
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


@dataclass
class Measured:
    """What the arbiter knows of one drafter."""

    accepted: float = 1.0  # decayed counts; the prior is α = 0.5
    rejected: float = 1.0
    seconds_per_token: float | None = None  # model drafts: one draft step (lookups: unused)
    idle: int = 0  # rounds since it last drafted

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass(frozen=True)
class Choice:
    speedup: float
    drafter: Drafter
    gamma: int
    tokens: tuple[int, ...] = ()  # a lookup's proposal, already made


class Arbiter:
    """Chooses per round among `lookups` and `models` (see the module docstring)."""

    name = "auto"

    def __init__(self, lookups: Sequence[Drafter], models: Sequence[Drafter] = (),
                 pass_costs: dict[int, float] | None = None, max_draft: int = 8, decay: float = 0.9,
                 smoothing: float = 0.3, probe_every: int = 16, model_cost_prior: float = 0.5) -> None:
        if not lookups and not models:
            raise ValueError("the arbiter needs at least one drafter")
        self.lookups, self.models = list(lookups), list(models)
        self.pass_costs = dict(pass_costs or {})
        self.max_draft, self.decay, self.smoothing, self.probe_every = max_draft, decay, smoothing, probe_every
        self.model_cost_prior = model_cost_prior  # draft-step cost of a model draft never run (a skip plan)
        self.measured = {d.name: Measured() for d in [*self.lookups, *self.models]}
        self.plain_seconds: float | None = None  # one plain target step
        self.verify_extra: float | None = None  # learned cost per verified token beyond the first, in plain steps

    def check(self, model: LoadedModel, target: LayerPlan) -> None:
        for drafter in [*self.lookups, *self.models]:
            drafter.check(model, target)

    def verify_cost(self, k: int) -> float:
        """A k-token verify pass, in plain steps."""
        return self.pass_costs.get(k, 1.0 + (k - 1) * (self.verify_extra or 0.0))  # unmeasured: optimistic

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def _best_gamma(self, alpha: float, limit: int, draft_cost: float) -> tuple[float, int]:
        return max((expected_speedup(alpha, g, draft_cost, self.verify_cost(g + 1)), g) for g in range(1, limit + 1))

    def choices(self, state: DraftState, max_tokens: int) -> list[Choice]:
        """Every candidate for this round with its best γ and expected speedup (lookups are run)."""
        found = []
        for drafter in self.lookups:
            measured = self.measured[drafter.name]
            if measured.idle < self.probe_every and self._best_gamma(measured.alpha, max_tokens, 0.0)[0] <= 1.0:
                continue  # could not pay even with its longest proposal: not asked until its probe
            tokens = drafter.propose(state, max_tokens).tokens[:max_tokens]
            if tokens:
                speedup, gamma = self._best_gamma(self.measured[drafter.name].alpha, len(tokens), 0.0)
                found.append(Choice(speedup, drafter, gamma, tuple(tokens)))
        for drafter in self.models:
            measured = self.measured[drafter.name]
            if measured.seconds_per_token is None or self.plain_seconds is None:
                cost = self.model_cost_prior
            else:
                cost = measured.seconds_per_token / self.plain_seconds
            speedup, gamma = self._best_gamma(measured.alpha, max_tokens, cost)
            found.append(Choice(speedup, drafter, gamma))
        return found

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        if self.plain_seconds is None:
            return Proposal()  # measure a plain step first: the unit every cost is counted in
        for measured in self.measured.values():
            measured.idle += 1
        found = self.choices(state, max_tokens)
        if not found:
            return Proposal()
        best = max(found, key=lambda c: c.speedup)
        if best.speedup <= 1.0:  # nothing pays: a plain step, unless a candidate is due for a probe
            due = [c for c in found if self.measured[c.drafter.name].idle >= self.probe_every]
            if not due:
                return Proposal()
            best = Choice(0.0, due[0].drafter, 1, due[0].tokens)
        self.measured[best.drafter.name].idle = 0
        if best.tokens:
            return Proposal(list(best.tokens[: best.gamma]), None, best.drafter.name)
        start = time.perf_counter()
        proposal = best.drafter.propose(state, best.gamma)
        if proposal.tokens:
            seconds = (time.perf_counter() - start) / len(proposal.tokens)
            measured = self.measured[best.drafter.name]
            measured.seconds_per_token = self._ema(measured.seconds_per_token, seconds)
        proposal.source = best.drafter.name
        return proposal

    def observe(self, outcome: RoundOutcome) -> None:
        if not outcome.drafted:
            self.plain_seconds = self._ema(self.plain_seconds, outcome.verify_seconds)
            return
        measured = self.measured.get(outcome.source or "")
        if measured is not None:
            measured.accepted = self.decay * measured.accepted + outcome.accepted
            measured.rejected = self.decay * measured.rejected + (outcome.accepted < outcome.drafted)
        if self.plain_seconds and outcome.drafted + 1 not in self.pass_costs:
            extra = (outcome.verify_seconds / self.plain_seconds - 1.0) / outcome.drafted
            self.verify_extra = min(max(self._ema(self.verify_extra, extra), 0.0), 1.0)
