"""The draft frontier: for a model on this machine, each drafter's measured acceptance against its
measured cost, beside the break-even curve that the verify costs draw.

A drafter with per-token acceptance α whose draft step costs c plain steps gives, at draft length
γ, (1 − α^(γ+1)) / (1 − α) tokens for γc + v(γ+1) steps (v(k): a k-token verify pass in steps,
from this machine's probe). It pays where some γ makes that ratio exceed 1; the break-even curve
is the least such α for each c. A point above the curve can pay, by as much as its predicted
speedup says; one below it cannot, at any draft length. Lookup drafters (n-gram, suffix) cost
nothing to draft (c ≈ 0) and pay wherever they agree at all; self-drafts sit at their c.

Measured here, in one run: a plain greedy decode of each prompt times a step; each drafter decodes
the same prompts at a fixed draft length, and its counts give α (the geometric model's estimate:
accepted / (accepted + rejections)) and its seconds c (draft seconds per drafted token over the
plain step). The measured speedup (plain time per token over its time per token) sits beside
the prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from layerplan.decoding.draft_length import FixedLength, expected_speedup
from layerplan.decoding.text import GenerationResult
from layerplan.engine.probe_rows import ProbeRow

# the pass lengths measured where no probe row gives the verify costs
PASS_LENGTHS = tuple(range(1, 10))
COST_REPEATS = 3  # timings of each pass length where no probe row gives the costs (pass_costs_of)

# the cost axis the break-even curve is drawn over (draft step / plain step)
CURVE_COSTS = tuple(round(0.05 * i, 2) for i in range(0, 25))


# decode(prompt, new_tokens, draft, draft_length) -> the greedy decode of one prompt's ids, plain
# (draft None) or speculative (a front end's: decoding/generate.py decode_by for a loaded model,
# lite/cli.py decode_loop for the light one's)
Decode = Callable[[Sequence[int], int, str | None, object], GenerationResult]


def pass_costs_of(probe_row: ProbeRow | None, model,
                  time_passes: Callable[[Any, Sequence[int], int], dict[int, float]]) -> dict[int, float]:
    """k -> a k-token pass in plain steps: the probe row's, else timed now on `model` by its front
    end's time_passes(model, lengths, repeats) (seconds of a pass over each k: engine/probe.py's or
    lite/probing.py's), COST_REPEATS times each."""
    if probe_row is not None and probe_row.relative:
        return dict(probe_row.relative)
    seconds = time_passes(model, PASS_LENGTHS, COST_REPEATS)
    return {k: t / seconds[1] for k, t in seconds.items()}


def self_drafts(model, plan: str | None = None) -> list[str]:
    """The drafts of the frontier's families for `model` (its num_layers and source): exits at
    half and three quarters of its layers, online skips, a searched skip plan if given, a 4-bit
    copy of it (where it has a file to quantize again from), and the lookups."""
    layers = model.num_layers
    exits = sorted({max(1, layers // 2), max(1, 3 * layers // 4)})
    copy = ["self:bits=q4_0"] if model.source and Path(model.source).exists() else []
    return [*(f"exit:{e}" for e in exits), "online", *([plan] if plan else []), *copy, "ngram", "suffix"]


def verify_cost(pass_costs: dict[int, float], k: int) -> float:
    """A k-token verify pass in plain steps: the probe's figure, else interpolated linearly from
    the nearest measured lengths (1 step for one token)."""
    if k in pass_costs:
        return pass_costs[k]
    known = sorted({1: 1.0, **pass_costs}.items())
    below = max(((n, c) for n, c in known if n <= k), default=known[0])
    above = min(((n, c) for n, c in known if n >= k), default=None)
    if above is None or above[0] == below[0]:
        # past the longest measured pass: its per-token slope on from there
        (n0, c0), (n1, c1) = known[-2] if len(known) > 1 else (0, 0.0), known[-1]
        return c1 + (k - n1) * (c1 - c0) / max(n1 - n0, 1)
    return below[1] + (k - below[0]) * (above[1] - below[1]) / (above[0] - below[0])


def best_length(alpha: float, draft_cost: float, pass_costs: dict[int, float], max_gamma: int = 8) -> tuple[int, float]:
    """(γ, predicted speedup over plain decoding) of the best draft length γ ∈ 0..max_gamma; γ = 0 is
    plain decoding (1.0)."""
    best = (0, 1.0)
    for gamma in range(1, max_gamma + 1):
        speedup = expected_speedup(alpha, gamma, draft_cost, verify_cost(pass_costs, gamma + 1))
        if speedup > best[1]:
            best = (gamma, speedup)
    return best


def break_even_acceptance(draft_cost: float, pass_costs: dict[int, float], max_gamma: int = 8) -> float | None:
    """The least per-token acceptance α at which some draft length beats plain decoding for a draft
    step of `draft_cost` plain steps; None where none does even at α = 1."""
    if best_length(1.0, draft_cost, pass_costs, max_gamma)[1] <= 1.0:
        return None
    low, high = 0.0, 1.0  # the best speedup grows with α: bisection
    for _ in range(40):
        middle = (low + high) / 2
        if best_length(middle, draft_cost, pass_costs, max_gamma)[1] > 1.0:
            high = middle
        else:
            low = middle
    return high


def acceptance_of(stats: dict) -> tuple[int, int]:
    """(accepted, rejections) of a speculative decode's counts: position i of a chain is tried only
    where every earlier position was accepted, and each try that is not accepted is a rejection."""
    drafted, accepted = stats.get("drafted_at", []), stats.get("accepted_at", [])
    rejections, tried = 0, None
    for i, times in enumerate(drafted):
        tried = times if i == 0 else min(times, accepted[i - 1])
        rejections += tried - (accepted[i] if i < len(accepted) else 0)
    return sum(accepted), rejections


@dataclass
class FrontierPoint:
    draft: str
    acceptance: float  # per-token α, geometric estimate
    draft_cost: float  # one draft step in plain steps, measured
    drafted: int
    accepted: int
    predicted_gamma: int  # the best draft length at (acceptance, draft_cost)
    predicted_speedup: float
    measured_speedup: float  # plain ms/token over this drafter's, at the fixed draft length
    above_break_even: bool


@dataclass
class FrontierResult:
    model: str
    precision: str
    cpu: str
    gamma: int  # the draft length every drafter was measured at
    plain_ms_per_token: float
    pass_costs: dict[int, float]
    points: list[FrontierPoint] = field(default_factory=list)
    curve: list[tuple[float, float | None]] = field(default_factory=list)  # (draft cost, break-even α)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def best(self) -> FrontierPoint | None:
        return max(self.points, key=lambda p: p.measured_speedup, default=None)


def measure_frontier(model, decode: Decode, drafts: Sequence[str], prompts: Sequence, pass_costs: dict[int, float],
                     new_tokens: int = 48, gamma: int = 4, cpu: str = "",
                     on_progress: Callable[[int, int], None] | None = None) -> FrontierResult:
    """Each draft's point on the frontier of `model` (its name and precision), decoded greedily by
    `decode` at the fixed draft length `gamma` (prompts: encoded ids); pass_costs: k -> a k-token
    pass in plain steps (the probe's)."""
    plain_seconds = plain_tokens = 0.0
    for prompt in prompts:
        result = decode(prompt, new_tokens, None, None)
        plain_seconds += result.seconds - result.prefill_seconds
        plain_tokens += len(result.token_ids)
    plain_step = plain_seconds / max(plain_tokens, 1)
    points = []
    for done, draft in enumerate(drafts, 1):
        seconds = tokens = accepted = rejections = drafted = 0
        draft_seconds = 0.0
        for prompt in prompts:
            result = decode(prompt, new_tokens, draft, FixedLength(gamma))
            seconds += result.seconds - result.prefill_seconds
            tokens += len(result.token_ids)
            ok, rejected = acceptance_of(result.stats)
            accepted, rejections = accepted + ok, rejections + rejected
            drafted += result.stats.get("drafted", 0)
            draft_seconds += result.stats.get("draft_seconds", 0.0)
        alpha = accepted / (accepted + rejections) if accepted + rejections else 0.0
        cost = draft_seconds / drafted / plain_step if drafted else 0.0
        best_gamma, predicted = best_length(alpha, cost, pass_costs, max(gamma, 8))
        threshold = break_even_acceptance(cost, pass_costs, max(gamma, 8))
        points.append(FrontierPoint(draft, alpha, cost, drafted, accepted, best_gamma, predicted,
                                    plain_step / (seconds / max(tokens, 1)) if seconds else 0.0,
                                    threshold is not None and alpha > threshold))
        if on_progress:
            on_progress(done, len(drafts))
    curve = [(c, break_even_acceptance(c, pass_costs)) for c in CURVE_COSTS]
    return FrontierResult(model.name, model.precision, cpu, gamma, plain_step * 1e3, dict(pass_costs), points, curve)
