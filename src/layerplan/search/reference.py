"""A reference plan's next-token distributions on fixed token ids, prepared once, against which
many candidate plans' logits are scored (a scan's, a search's), and the evaluator both front ends'
scans and searches score plans by (ResumingEvaluator), and a model's decode costs (CostModel,
measured_costs): numpy, no torch. search/evaluate.py's Reference gives the scorer torch's logits.

For each position the reference keeps its probabilities p (float32), its log-sum-exp, its argmax
and Σ p·ref (a float64 sum), so a candidate costs one max, one exp-sum and one dot product over
the vocabulary:
    KL(ref || cand) = logsumexp(cand) - logsumexp(ref) - (Σ p·cand - Σ p·ref).
Candidates are scored over chunks of positions, so a candidate's whole logits need not exist at
once."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from layerplan.plan.plan import LayerPlan
from layerplan.search.windows import Divergence

CHUNK_ROWS = 32  # positions scored at once (32 x 151,936 floats: 19 MB, in cache for the metrics)
BLOCK_ROWS = 256  # positions a logits_of call gives (an LM head is ~15% faster on 256 rows than on 64)

# (sequence b, positions [start, end)) -> their logits (end - start, vocab), float32, an array the
# scorer may overwrite
LogitsOfRows = Callable[[int, int, int], np.ndarray]


def _chunks(logits_of: LogitsOfRows, batch: int, length: int, block_rows: int,
            chunk_rows: int) -> Iterator[tuple[int, int, int, np.ndarray]]:
    """(b, start, end, logits) over every position: logits_of on blocks of `block_rows` positions,
    handed out in chunks of `chunk_rows` rows; each row once."""
    for b in range(batch):
        for block_start in range(0, length, block_rows):
            block_end = min(block_start + block_rows, length)
            block = logits_of(b, block_start, block_end)
            for start in range(block_start, block_end, chunk_rows):
                end = min(start + chunk_rows, block_end)
                yield b, start, end, block[start - block_start:end - block_start]


def _log_sum_exp(rows: np.ndarray, top: np.ndarray) -> np.ndarray:
    """float32 (c,): log Σ exp of each row of float32 rows (c, V) whose maxima are `top`;
    overwrites rows with exp(rows - top)."""
    np.subtract(rows, top[:, None], out=rows)
    np.exp(rows, out=rows)
    return top + np.log(rows.sum(axis=1))


class LogitsReference:
    """The reference's distributions on ids (B, T) (see the module's docstring). logits_of gives
    its logits by blocks of positions (block_rows at a time), scored chunk_rows at a time."""

    def __init__(self, logits_of: LogitsOfRows, ids: np.ndarray, block_rows: int = BLOCK_ROWS,
                 chunk_rows: int = CHUNK_ROWS) -> None:
        self.ids = np.asarray(ids, np.int64)
        self.ids = self.ids.reshape(1, -1) if self.ids.ndim == 1 else self.ids
        batch, length = self.ids.shape
        if length < 2:
            raise ValueError("scoring needs at least 2 tokens a sequence")
        self.block_rows, self.chunk_rows = block_rows, chunk_rows
        self.probs: np.ndarray | None = None  # (B, T, V), allocated once the vocabulary is known
        self.lse = np.empty((batch, length), np.float32)
        self.top1 = np.empty((batch, length), np.int64)
        self.expected_logit = np.empty((batch, length), np.float32)  # Σ p·ref per position (a float64 sum)
        self._products: np.ndarray | None = None  # a chunk's p·cand
        nll_sum = 0.0
        for b, start, end, part in _chunks(logits_of, batch, length, block_rows, chunk_rows):
            if self.probs is None:
                self.probs = np.empty((batch, length, part.shape[1]), np.float32)
            self.top1[b, start:end] = part.argmax(axis=1)
            picked = self._picked(part, b, start, end)
            lse = _log_sum_exp(part.copy(), part.max(axis=1))
            probs = self.probs[b, start:end]
            np.subtract(part, lse[:, None], out=probs)
            np.exp(probs, out=probs)
            self.lse[b, start:end] = lse
            self.expected_logit[b, start:end] = np.einsum("ij,ij->i", probs.astype(np.float64),
                                                          part.astype(np.float64))
            nll_sum += float((lse[:len(picked)] - picked).sum(dtype=np.float64))
        self.perplexity = math.exp(nll_sum / (batch * (length - 1)))

    def _picked(self, logits: np.ndarray, b: int, start: int, end: int) -> np.ndarray:
        """The logits of the next tokens of the chunk's positions that predict one."""
        scored = max(min(end, self.ids.shape[1] - 1) - start, 0)
        return logits[np.arange(scored), self.ids[b, start + 1:start + 1 + scored]]

    def divergence(self, logits_of: LogitsOfRows, plan: str = "",
                   give_up: Callable[[Divergence], bool] | None = None, block_rows: int | None = None,
                   chunk_rows: int | None = None) -> Divergence:
        """A candidate's divergence from the reference, its logits given by blocks of positions.
        give_up(bounds): called after each chunk but the last with the bounds so far
        (complete=False); True stops scoring and returns them (per-position KL and NLL are >= 0,
        so partial sums bound the means from below; agreement is bounded above by assuming the
        unscored positions agree)."""
        batch, length = self.ids.shape
        positions, predicting = batch * length, batch * (length - 1)
        kl_sum, nll_sum, agree, done = 0.0, 0.0, 0, 0
        for b, start, end, logits in _chunks(logits_of, batch, length, block_rows or self.block_rows,
                                             chunk_rows or self.chunk_rows):
            agree += int((logits.argmax(axis=1) == self.top1[b, start:end]).sum())
            # (products summed pairwise: einsum's and matmul's float32 sums of 151,936 terms drift
            # by 1e-5 to 1e-3 a row, all one way, where a good plan's KL is ~1e-3)
            if self._products is None or self._products.shape[0] < end - start:
                self._products = np.empty((end - start, logits.shape[1]), np.float32)
            products = np.multiply(self.probs[b, start:end], logits, out=self._products[:end - start])
            shift = products.sum(axis=1) - self.expected_logit[b, start:end]
            picked = self._picked(logits, b, start, end)
            lse = _log_sum_exp(logits, logits.max(axis=1))
            kl_sum += float((lse - self.lse[b, start:end] - shift).sum(dtype=np.float64))
            nll_sum += float((lse[:len(picked)] - picked).sum(dtype=np.float64))
            done += end - start
            if give_up is not None and done < positions:
                bounds = Divergence(math.exp(nll_sum / predicting), self.perplexity, max(kl_sum / positions, 0.0),
                                    (agree + positions - done) / positions, positions, plan, False)
                if give_up(bounds):
                    return bounds
        return Divergence(perplexity=math.exp(nll_sum / predicting), reference_perplexity=self.perplexity,
                          kl=max(kl_sum / positions, 0.0),  # rounding can make an exact match read -1e-8
                          top1_agreement=agree / positions, tokens=positions, plan=plan)


SubLayer = tuple[int, str]  # (plan step index, "attention" or "mlp"): a point of a pass's residual stream


def first_difference(plan: LayerPlan, reference: LayerPlan) -> SubLayer | None:
    """The first (step, sub-layer) where `plan` differs from `reference` (the residual stream is
    the same up to there); None where they are the same."""
    for i, step in enumerate(plan.active_steps):
        if i >= len(reference.active_steps):
            return 0, "attention"  # longer than the reference: nothing captured to resume from
        other = reference.steps[i]
        if step.layer != other.layer or step.scale != other.scale:
            return i, "attention"
        if step.attention != other.attention:
            return i, "attention"
        if step.mlp != other.mlp:
            return i, "mlp"
    if len(plan.active_steps) != len(reference.active_steps):
        return len(plan.active_steps), "attention"  # an earlier exit: resume at the exit
    return None


class ResumingEvaluator:
    """Quality of many plans against one reference plan on fixed ids: what a scan and a search ask
    of a model (search/importance.py, search/plan_search.py). A front end's evaluator captures the
    reference's residual stream before every sub-layer once (`captured`), runs each candidate from
    its first difference (`run`), and scores its final hidden states (`score`); results are
    memoised by plan."""

    model: Any  # the front end's model: .name, .num_layers, .plan(text)
    name: str  # the model's
    tokens: int  # the ids' count
    reference: Any  # .perplexity: the reference plan's (a LogitsReference, or search/evaluate.py's Reference)

    def __init__(self, reference_plan: LayerPlan, reuse: bool) -> None:
        self.reference_plan = reference_plan
        self.reuse = reuse  # False: every candidate from the embeddings, no memo (the naive baseline)
        self.captured: dict[SubLayer, Any] = {}  # the reference's residual stream before each sub-layer
        self.final_hidden: Any = None  # the reference's after its last step
        self.cache: dict[LayerPlan, Divergence] = {}
        self.evaluations = 0  # model runs actually made (memo hits excluded)
        self.aborted = 0  # of which stopped early because they could no longer matter

    def run(self, plan: LayerPlan, resume: SubLayer | None) -> Any:
        """The plan's final hidden states, from the captured stream at `resume` (None: from the
        embeddings)."""
        raise NotImplementedError

    def score(self, hidden: Any, plan: str, give_up: Callable[[Divergence], bool] | None) -> Divergence:
        """The divergence of final hidden states from the reference's (LogitsReference.divergence)."""
        raise NotImplementedError

    def divergence(self, plan: LayerPlan, give_up: Callable[[Divergence], bool] | None = None) -> Divergence:
        """give_up: see LogitsReference.divergence; an early-stopped result is not memoised."""
        if self.reuse and plan in self.cache:
            return self.cache[plan]
        point = first_difference(plan, self.reference_plan)
        if not self.reuse:
            hidden = self.run(plan, None)
        elif point is None:  # the reference plan itself
            hidden = self.final_hidden
        elif point[0] >= len(plan.active_steps):  # nothing left to run: the exit point itself
            hidden = self.captured[(point[0], "attention")]
        else:
            hidden = self.run(plan, point)
        self.evaluations += 1
        result = self.score(hidden, plan.to_string(), give_up)
        if result.complete:
            self.cache[plan] = result
        else:
            self.aborted += 1
        return result


@dataclass(frozen=True)
class CostModel:
    """Seconds of one decode step, split into a fixed part (embeddings, LM head, overheads) and
    per-sub-layer averages, measured on the model in its dtype on this machine."""

    full_step: float
    fixed: float
    attention: float  # one attention sub-layer
    mlp: float  # one MLP sub-layer

    def relative_cost(self, plan: LayerPlan) -> float:
        """c: one decode step of `plan` divided by one step of the full model."""
        attention = sum(s.attention for s in plan.active_steps)
        mlp = sum(s.mlp for s in plan.active_steps)
        return (self.fixed + attention * self.attention + mlp * self.mlp) / self.full_step

    def to_dict(self) -> dict:
        return asdict(self)


def measured_costs(step: Callable[[LayerPlan], Callable[[], None]], fixed: Callable[[], Any], layers: int,
                   repeats: int = 12) -> CostModel:
    """Median times of one-token decode steps (step(plan): a run of one step of `plan` after a
    context, leaving the cache as it found it): the full model, every attention off, every MLP off;
    and of `fixed` (embeddings + LM head alone). The per-sub-layer parts are scaled so that the
    parts add up to the full step exactly (timings on a busy machine need not)."""
    def median(run: Callable[[], Any]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    full_s = median(step(LayerPlan.full(layers)))
    no_attention = median(step(LayerPlan.from_skips(layers, attention=range(layers))))
    no_mlp = median(step(LayerPlan.from_skips(layers, mlp=range(layers))))
    fixed_s = min(median(fixed), full_s)
    attention = max(full_s - no_attention, 1e-9)
    mlp = max(full_s - no_mlp, 1e-9)
    share = (full_s - fixed_s) / (attention + mlp)  # make fixed + all sub-layers == the full step
    return CostModel(full_s, fixed_s, attention * share / layers, mlp * share / layers)
