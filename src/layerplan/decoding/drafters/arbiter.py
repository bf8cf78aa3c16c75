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
machine was probed, else learned from the verify passes seen (1 + (k − 1)·extra; before the first
one, as cheap as a step). A pass size neither probed nor seen is not bet on: a round drafts at
most `reach` tokens more than the longest pass seen (without it, the first drafted round of a
prose answer drafted eight tokens that a 9-token pass, 2.5 steps, then rejected: 2.3% of a
64-token answer on SmolLM2, 3.4% on Gemma 3; tests/test_arbiter_replay.py).

Never slower than plain (issue 29): that formula is a model, and a model can be wrong about a
machine or a text (a probe row timed for other weights or beside other load: verify passes dearer
than it says; acceptance that is not geometric; the lookups' and the arbiter's own time per round).
So each candidate's predicted speedup is scaled by its `calibration` κ ≤ 1: what its rounds
actually gave (tokens per round time, in plain steps, every second of the round counted) over what
the formula predicted for them. κ only ever lowers a prediction: a wrong model can make the
arbiter miss a gain, never keep a loss going. And exploration is paid for: a candidate not chosen
gets a one-token probe round, so that acceptance that recovers with the text is noticed, but no
more often than keeps the probe's expected loss under `probe_budget` of the rounds between
(probe_interval): on a model where no draft pays, probing costs at most that share per candidate.
Last, a ledger bounds what any model error can cost in all: `ledger` sums, over the drafting
rounds, tokens emitted minus the round's cost in plain steps (what the round gained on plain), and
a round drafts only when, were every draft rejected, the ledger would stay above
−(loss_credit + loss_budget · rounds). So a generation never falls more than that (plus one
round's misjudged cost) behind plain, from the first round on: a 48-token run where nothing pays
loses at most ~1.3 steps, while a run whose drafts pay earns the room to try more.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from layerplan.decoding.draft_length import expected_speedup, expected_tokens, probe_interval
from layerplan.decoding.drafters.proposal import DraftState, Drafter, Proposal, RoundOutcome
from layerplan.plan.plan import LayerPlan


@dataclass
class Measured:
    """What the arbiter knows of one drafter."""

    accepted: float = 1.0  # decayed counts; the prior is α = 0.5
    rejected: float = 1.0
    seconds_per_token: float | None = None  # model drafts: one draft step (lookups: unused)
    idle: int = 0  # rounds since it last drafted
    # its drafting rounds, decayed like the counts: tokens emitted and round cost in plain steps,
    # as measured and as the formula predicted them; the prior (one round as predicted) is κ = 1
    tokens: float = 1.0
    steps: float = 1.0
    predicted_tokens: float = 1.0
    predicted_steps: float = 1.0
    rounds: int = 0  # its drafting rounds counted in κ

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def calibration(self) -> float:
        """κ ∈ (0, 1]: measured speedup of its rounds over the predicted one (capped at 1)."""
        measured = self.tokens / self.steps
        predicted = self.predicted_tokens / self.predicted_steps
        return min(1.0, measured / predicted)


@dataclass(frozen=True)
class Choice:
    speedup: float  # predicted, κ applied
    drafter: Drafter
    gamma: int
    tokens: tuple[int, ...] = ()  # a lookup's proposal, already made
    cost: float = 0.0  # one draft step, in plain steps (lookups: 0)


class Arbiter:
    """Chooses per round among `lookups` and `models` (see the module docstring)."""

    name = "auto"

    def __init__(self, lookups: Sequence[Drafter], models: Sequence[Drafter] = (),
                 pass_costs: dict[int, float] | None = None, max_draft: int = 8, decay: float = 0.9,
                 smoothing: float = 0.3, probe_every: int = 16, model_cost_prior: float | None = None,
                 probe_budget: float = 0.005, loss_credit: float = 0.3, loss_budget: float = 0.02,
                 reach: int | None = 2, least_gain: float = 0.05) -> None:
        if not lookups and not models:
            raise ValueError("the arbiter needs at least one drafter")
        self.lookups, self.models = list(lookups), list(models)
        self.pass_costs = dict(pass_costs or {})
        self.max_draft, self.decay, self.smoothing, self.probe_every = max_draft, decay, smoothing, probe_every
        self.probe_budget = probe_budget  # a probe's expected loss, as a share of the rounds between probes
        self.loss_credit, self.loss_budget = loss_credit, loss_budget  # the ledger's floor (module docstring)
        self.ledger = 0.0  # Σ over drafting rounds of (tokens emitted − round cost in plain steps)
        self.rounds = 0  # every round observed, plain ones included
        # draft-step cost of a model draft never run (None: a self-draft's plan's share of the
        # sub-layers, else half a step)
        self.model_cost_prior = model_cost_prior
        self.least_gain = least_gain
        self.measured = {d.name: Measured() for d in [*self.lookups, *self.models]}
        self.plain_seconds: float | None = None  # one plain target step
        self.verify_extra: float | None = None  # learned cost per verified token beyond the first, in plain steps
        self.reach = reach  # at most this many tokens more than the longest pass seen (None: any)
        self.longest_pass = 1  # tokens in the longest verify pass seen
        self._gammas: dict[tuple[float, int, float], tuple[float, int]] = {}  # _best_gamma's answers, while
        # the verify costs stay as they are (most rounds change neither α nor them: a plain step)
        self.pending: tuple[str, float, float] | None = None  # this round's drafter, its α and draft cost

    def check(self, model, target: LayerPlan) -> None:
        for drafter in [*self.lookups, *self.models]:
            drafter.check(model, target)

    def verify_cost(self, k: int) -> float:
        """A k-token verify pass, in plain steps."""
        return self.pass_costs.get(k, 1.0 + (k - 1) * (self.verify_extra or 0.0))  # unmeasured: optimistic

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def _best_gamma(self, alpha: float, limit: int, draft_cost: float) -> tuple[float, int]:
        key = (alpha, limit, draft_cost)
        best = self._gammas.get(key)
        if best is None:
            best = max((expected_speedup(alpha, g, draft_cost, self.verify_cost(g + 1)), g) for g in range(1, limit + 1))
            if len(self._gammas) > 4096:
                self._gammas.clear()
            self._gammas[key] = best
        return best

    def _due(self, measured: Measured, draft_cost: float) -> bool:
        """Whether a candidate not chosen lately is due a one-token probe: its idle rounds reach
        probe_interval of what that probe is expected to lose (κ not applied: the probe is there to
        measure it again). Never, for a draft that would not gain `least_gain` were every token
        of it accepted (a skip plan that runs nearly every sub-layer): its probe could only lose.
        (A lookup costs nothing to ask: its probes go on, so that verify costs are learned again.)"""
        if draft_cost > 0 and self._best_gamma(1.0, self.max_draft, draft_cost)[0] < 1.0 + self.least_gain:
            return False
        if not measured.rounds:  # never drafted: its first try comes after probe_every
            return measured.idle >= self.probe_every
        loss = draft_cost + self.verify_cost(2) - expected_tokens(measured.alpha, 1)
        return measured.idle >= probe_interval(loss, self.probe_every, self.probe_budget)

    def choices(self, state: DraftState, max_tokens: int) -> list[Choice]:
        """Every candidate for this round with its best γ and expected speedup (lookups are run)."""
        if self.reach is not None and max_tokens + 1 not in self.pass_costs:
            max_tokens = min(max_tokens, self.longest_pass - 1 + self.reach)
        found = []
        for drafter in self.lookups:
            measured = self.measured[drafter.name]
            best = self._best_gamma(measured.alpha, max_tokens, 0.0)[0] * measured.calibration
            if best <= 1.0 and not self._due(measured, 0.0):
                continue  # could not pay even with its longest proposal: not asked until its probe
            tokens = drafter.propose(state, max_tokens).tokens[:max_tokens]
            if tokens:
                speedup, gamma = self._best_gamma(measured.alpha, len(tokens), 0.0)
                found.append(Choice(speedup * measured.calibration, drafter, gamma, tuple(tokens)))
        for drafter in self.models:
            measured = self.measured[drafter.name]
            if measured.seconds_per_token is None or self.plain_seconds is None:
                cost = self.model_cost_prior
                if cost is None:
                    cost = getattr(getattr(drafter, "plan", None), "cost", None) or 0.5
            else:
                cost = measured.seconds_per_token / self.plain_seconds
            speedup, gamma = self._best_gamma(measured.alpha, max_tokens, cost)
            found.append(Choice(speedup * measured.calibration, drafter, gamma, cost=cost))
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
            due = [c for c in found if self._due(self.measured[c.drafter.name], c.cost)]
            if not due:
                return Proposal()
            best = Choice(0.0, due[0].drafter, 1, due[0].tokens, due[0].cost)
        floor = -(self.loss_credit + self.loss_budget * self.rounds)
        gamma = best.gamma  # the longest γ ≤ the chosen one whose round, all rejected, keeps the ledger above its floor
        while gamma and self.ledger - (gamma * best.cost + self.verify_cost(gamma + 1) - 1.0) < floor:
            gamma -= 1
        if not gamma:
            return Proposal()
        best = Choice(best.speedup, best.drafter, gamma, best.tokens, best.cost)
        self.measured[best.drafter.name].idle = 0
        self.pending = (best.drafter.name, self.measured[best.drafter.name].alpha, best.cost)
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
        pending, self.pending = self.pending, None
        self.rounds += 1
        if outcome.drafted and self.plain_seconds:
            round_steps = (outcome.draft_seconds + outcome.verify_seconds) / self.plain_seconds
            self.ledger += outcome.accepted + 1 - round_steps
        if not outcome.drafted:
            self.plain_seconds = self._ema(self.plain_seconds, outcome.verify_seconds)
            return
        self.longest_pass = max(self.longest_pass, outcome.drafted + 1)
        measured = self.measured.get(outcome.source or "")
        if measured is not None and pending is not None and pending[0] == outcome.source and self.plain_seconds:
            # κ: this round as measured (all of its time: the draft, the lookups asked, the
            # verify pass) against the formula's prediction for what was drafted, with the α and
            # draft cost it was chosen with; priced before this round's own verify cost is learned
            _, alpha, cost = pending
            d = self.decay
            measured.rounds += 1
            measured.tokens = d * measured.tokens + outcome.accepted + 1
            measured.steps = d * measured.steps + round_steps
            measured.predicted_tokens = d * measured.predicted_tokens + expected_tokens(alpha, outcome.drafted)
            measured.predicted_steps = d * measured.predicted_steps + outcome.drafted * cost + self.verify_cost(
                outcome.drafted + 1)
        if measured is not None:
            measured.accepted = self.decay * measured.accepted + outcome.accepted
            measured.rejected = self.decay * measured.rejected + (outcome.accepted < outcome.drafted)
        if self.plain_seconds and outcome.drafted + 1 not in self.pass_costs:
            extra = (outcome.verify_seconds / self.plain_seconds - 1.0) / outcome.drafted
            self.verify_extra = min(max(self._ema(self.verify_extra, extra), 0.0), 1.0)
            self._gammas.clear()  # the verify costs changed
