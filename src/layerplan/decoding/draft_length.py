"""How many tokens to draft per round: fixed, transformers' heuristic, or adaptive (from measured
acceptance and costs, by the speedup formula of Leviathan et al.). DRAFT_LENGTHS is the registry
the CLI's --draft-length choices come from."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


class FixedLength:
    """Always draft γ tokens."""

    def __init__(self, gamma: int = 4) -> None:
        self.gamma = gamma

    def next_gamma(self, others: int = 0) -> int:
        return self.gamma

    def update(self, gamma: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass


class HeuristicLength(FixedLength):
    """transformers' schedule: +2 after a fully accepted round, −1 otherwise (at least 1)."""

    def __init__(self, gamma: int = 4, max_gamma: int = 16) -> None:
        super().__init__(gamma)
        self.max_gamma = max_gamma

    def update(self, gamma: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if drafted:
            self.gamma = min(self.max_gamma, self.gamma + 2) if accepted == drafted else max(1, self.gamma - 1)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a round of γ drafts emits on average with per-token acceptance α (accepted + 1)."""
    return gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.: tokens per round / cost per round, in units of one plain target step.
    alpha: per-token acceptance; draft_cost: one draft step; verify_cost: one verify pass."""
    if gamma == 0:
        return 1.0
    return expected_tokens(alpha, gamma) / (gamma * draft_cost + verify_cost)


def probe_interval(loss: float, every: int, budget: float) -> int:
    """Rounds between one-token probes of a draft that does not pay now: at least `every`, and
    enough that a probe expected to lose `loss` plain steps (its cost minus its expected tokens)
    costs at most `budget` of the plain rounds between. A probe of a draft at α = 0.3 and 0.7 of
    a step per token, verified in 1.2 steps, loses 0.6 steps: every 16 rounds that is 3.5%, below
    the 0.97x plain that `auto` promises on its own."""
    return max(every, math.ceil(loss / budget)) if budget > 0 else every


@dataclass
class SharedRounds:
    """What the requests that share a drafter (a server's, one generate_batch call's, each drafter
    spec and plan its own) learned of its rounds: decayed acceptance counts and the last measured
    step times, updated by every request's rounds. A request's adaptive length starts from them
    instead of the prior (α = 0.5, costs unmeasured): where drafts do not pay, a new request does
    not spend its first rounds finding it out again (the probes every `probe_every` rounds stay)."""

    accepted_count: float = 1.0
    rejected_count: float = 1.0
    plain_step: float | None = None
    draft_step: float | None = None
    verify_extra: float = 0.0


class AdaptiveLength:
    """Picks γ ∈ 0..max_gamma maximising the expected speedup from measured acceptance and costs;
    γ = 0 (plain decoding) when no γ is expected to beat plain, probing again every
    `probe_every` rounds so that a drafter that starts to pay is noticed.

    Measured in the same run: a plain round times one target step; a drafting round times its
    draft steps and its verify pass. Per-token acceptance α follows the geometric model behind
    the formula: accepted tokens / (accepted + rejections), over exponentially decayed counts."""

    def __init__(self, max_gamma: int = 8, probe_every: int = 16, decay: float = 0.9, smoothing: float = 0.3,
                 pass_costs: dict[int, float] | None = None, shared: SharedRounds | None = None) -> None:
        self.max_gamma, self.probe_every, self.decay, self.smoothing = max_gamma, probe_every, decay, smoothing
        # k -> cost of a k-token pass in plain steps, from this machine's probe (engine/probe.py):
        # the verify cost of γ drafts is pass_costs[γ+1] from the first round on, instead of a
        # per-token extra learned over the first rounds of every request
        self.pass_costs = dict(pass_costs or {})
        self.accepted_count, self.rejected_count = 1.0, 1.0  # prior: α = 0.5
        self.plain_step: float | None = None  # seconds of one plain target step
        self.draft_step: float | None = None  # seconds of one draft step
        self.verify_extra = 0.0  # verify seconds beyond a plain step, per drafted token
        self.since_probe = 0
        self.gamma = min(4, max_gamma)  # first drafting round
        self.shared = shared
        if shared is not None:  # what the other requests of this drafter measured, as this one's start
            self.accepted_count, self.rejected_count = shared.accepted_count, shared.rejected_count
            self.plain_step, self.draft_step = shared.plain_step, shared.draft_step
            self.verify_extra = shared.verify_extra

    @property
    def alpha(self) -> float:
        return self.accepted_count / (self.accepted_count + self.rejected_count)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def next_gamma(self, others: int = 0) -> int:
        """γ for the next round. others: the rows a batch's pass carries for other requests; each
        γ is then weighed by what its rows add to that pass (see best_gamma), so a busy pass
        drafts less."""
        if self.plain_step is None or self.draft_step is None:
            return self.best_gamma(others)  # a plain step first, then one drafting round
        best = self.best_gamma(others)
        if best == 0:
            self.since_probe += 1
            # a probe's row in a shared pass costs every request in it; where the requests share
            # what they measure (SharedRounds), each one's probes inform the others: each probes
            # (others + 1) times less often, so the pass as a whole probes at the solo rate
            every = self.probe_every * (others + 1 if self.shared is not None else 1)
            if self.since_probe >= every:
                self.since_probe = 0
                return 1  # probe: acceptance may have changed with the text
        return best

    def best_gamma(self, others: int = 0) -> int:
        """The γ of the highest expected speedup over plain decoding (0: none beats it), from the
        measured acceptance and costs. In a pass that carries `others` rows for other requests
        (each a token), and where the probe's pass costs c(k) cover it, the speedup is the pass's:
        (others + E(α, γ)) tokens for c(others + 1 + γ) + γ·draft steps, against others + 1 tokens
        for c(others + 1). Rows a pass carries for free (bound by reading the weights) pay for
        drafts alone, not in a batch that already fills them: a busy pass drafts less. Without
        the probe's costs a shared pass drafts nothing: what a request learns of its verify passes
        alone says nothing of the rows a batch's pass already carries, and where the products are
        bound by arithmetic (a CPU's int8 tiles at 4-8 rows) a row costs nearly its share of a
        step. Before a plain step and a drafting round are measured: what next_gamma measures them
        with."""
        costs = self.pass_costs
        batched = others > 0 and others + 1 in costs
        if others > 0 and not batched:
            return 0
        if self.plain_step is None or self.draft_step is None:
            return 0 if self.plain_step is None else self.gamma
        draft_cost = self.draft_step / self.plain_step
        verify_cost = self.verify_extra / self.plain_step
        plain = (others + 1) / costs[others + 1] if batched else 1.0  # tokens per step of a plain pass
        best, best_s = 0, 1.0
        for gamma in range(1, self.max_gamma + 1):
            if batched:
                if others + 1 + gamma not in costs:  # past the probe's longest pass: no cost to weigh
                    break
                tokens = others + expected_tokens(self.alpha, gamma)
                s = tokens / (costs[others + 1 + gamma] + gamma * draft_cost) / plain
            else:
                verify = costs.get(gamma + 1, 1.0 + gamma * verify_cost)
                s = expected_speedup(self.alpha, gamma, draft_cost, verify)
            if s > best_s:
                best, best_s = gamma, s
        return best

    def update(self, gamma: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self._update(gamma, drafted, accepted, draft_s, verify_s)
        shared = self.shared
        if shared is None:
            return
        shared.plain_step, shared.draft_step, shared.verify_extra = self.plain_step, self.draft_step, self.verify_extra
        if drafted:  # the shared counts decay by every request's drafting rounds, as each one's own do
            shared.accepted_count = self.decay * shared.accepted_count + accepted
            shared.rejected_count = self.decay * shared.rejected_count + (accepted < drafted)

    def _update(self, gamma: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if gamma == 0 or self.plain_step is None:
            self.plain_step = self._ema(self.plain_step, verify_s)
            return
        if drafted == 0:  # the drafter had nothing (no n-gram match): a plain step plus lookup time
            self.plain_step = self._ema(self.plain_step, verify_s)
            return
        self.draft_step = self._ema(self.draft_step, draft_s / drafted)
        extra = (verify_s - self.plain_step) / drafted
        self.verify_extra = min(max(self._ema(self.verify_extra, extra), 0.0), self.plain_step)
        self.accepted_count = self.decay * self.accepted_count + accepted
        self.rejected_count = self.decay * self.rejected_count + (accepted < drafted)


@dataclass(frozen=True)
class DraftLength:
    help: str
    # (gamma, pass costs, shared rounds or None) -> a policy with next_gamma() and update()
    make: Callable[[int, dict[int, float], SharedRounds | None], object]


DRAFT_LENGTHS = {
    "fixed": DraftLength("always γ tokens", lambda gamma, costs, shared: FixedLength(gamma)),
    "heuristic": DraftLength("transformers' schedule: +2 after a fully accepted round, -1 otherwise",
                             lambda gamma, costs, shared: HeuristicLength(gamma)),
    "adaptive": DraftLength("γ from measured acceptance and cost (the probe's pass costs when cached), plain "
                            "decoding when drafting does not pay",
                            lambda gamma, costs, shared: AdaptiveLength(max_gamma=max(gamma, 1) * 2, pass_costs=costs,
                                                                        shared=shared)),
}
DEFAULT_DRAFT_LENGTH = "adaptive"
# a seeded sampled request's default: its lengths follow its own rounds, so the seed repeats the sample
SEEDED_DRAFT_LENGTH = "heuristic"


def make_draft_length(spec: str | object | None, gamma: int = 4, pass_costs: dict[int, float] | None = None,
                      shared: SharedRounds | None = None):
    """A policy by name (see DRAFT_LENGTHS; default adaptive), or a policy object as it is. shared:
    what other requests of the same drafter learned (SharedRounds), for a policy that learns."""
    if spec is None:
        spec = DEFAULT_DRAFT_LENGTH
    if not isinstance(spec, str):
        return spec
    if spec not in DRAFT_LENGTHS:
        raise ValueError(f"unknown draft length policy '{spec}'; choose from {', '.join(DRAFT_LENGTHS)}")
    return DRAFT_LENGTHS[spec].make(gamma, pass_costs or {}, shared)


def draft_length_help() -> str:
    """One clause per policy, for the CLI."""
    marks = {DEFAULT_DRAFT_LENGTH: " (default)", SEEDED_DRAFT_LENGTH: " (a seeded sample's default)"}
    return "; ".join(f"{name}{marks.get(name, '')}: {kind.help}" for name, kind in DRAFT_LENGTHS.items())
