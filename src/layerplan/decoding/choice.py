"""The next token from numpy logits, without torch: greedy or sampled, as every plain decode
chooses it (decoding/loop.py's loop, on both front ends), and the draws of speculative rounds
(acceptance.py, drafters/base.py) from the same generator by the same rule.

The logits are processed in float32 (the logit bias, then the repetition penalty on the
context's tokens, then presence and frequency on the generated ones; for a sample then the
temperature, top-k, top-p and min-p): the one definition, which a speculative round's rows take
too (rounds.py target_pick, target_probs), so that its p is the distribution a plain step samples
from and its greedy picks are plain greedy's tokens. A sample is one uniform draw of the
request's numpy Generator against the processed distribution's cumulative weights in float64
(`draw`): a seed gives the same tokens on either front end, on any device the logits came from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from layerplan.decoding.sampling_params import SamplingParams


def seeded_generator(seed: int | None) -> np.random.Generator:
    """A request's generator: seeded where a seed is given (any of limits.py's SEED_RANGE, taken
    modulo 2**64), else from the system's entropy."""
    return np.random.default_rng(seed % 2 ** 64 if seed is not None else None)


def processed_logits(logits: np.ndarray, params: SamplingParams, context: Sequence[int],
                     output_from: int) -> np.ndarray:
    """The logits (V,) as params process them, in float32 (a copy: the caller's row stays as it
    is); a token dropped by top-k, top-p or min-p is -inf. context: the tokens so far, those from
    output_from on generated (the presence and frequency penalties' count)."""
    processed = np.array(logits, dtype=np.float32)
    if params.logit_bias:
        tokens = np.array([token for token, _ in params.logit_bias], dtype=np.int64)
        np.add.at(processed, tokens, np.array([bias for _, bias in params.logit_bias], dtype=np.float32))
    if params.repetition_penalty != 1.0 and len(context):
        ids = np.unique(np.asarray(context, dtype=np.int64))
        picked = processed[ids]
        penalty = np.float32(params.repetition_penalty)
        processed[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    output = np.asarray(context[output_from:], dtype=np.int64)
    if (params.presence_penalty or params.frequency_penalty) and output.size:
        counts = np.bincount(output, minlength=processed.shape[-1])[: processed.shape[-1]].astype(np.float32)
        processed = (processed - np.float32(params.frequency_penalty) * counts
                     - np.float32(params.presence_penalty) * (counts > 0).astype(np.float32))
    if params.greedy:
        return processed
    processed = processed / np.float32(params.temperature)
    vocab = processed.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = np.partition(processed, vocab - params.top_k)[vocab - params.top_k]  # the k-th largest
        processed[processed < kth] = -np.inf
    if params.top_p < 1.0:
        processed[~top_p_kept(processed, params.top_p)] = -np.inf
    if params.min_p > 0.0:  # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        processed[processed < processed.max() + np.float32(math.log(params.min_p))] = -np.inf
    return processed


def top_p_kept(logits: np.ndarray, top_p: float, whole: bool = False) -> np.ndarray:
    """Which tokens top-p keeps (bool, V): in the order of the logits (highest first, ties by id), a
    token goes once the probabilities before it reach top_p (the first always stays).

    Only the candidates are sorted (whole: every token), those of probability at least
    (1 - top_p) / V: the others sum to less than 1 - top_p and come after them in that order, so
    they are dropped once the candidates' running sum reaches top_p, as it then must (checked: where
    rounding leaves it short, every token is sorted). A whole vocabulary's sort costs a decode
    step's time over again at 152k tokens."""
    vocab = logits.shape[-1]
    weights = np.exp(logits - logits.max())
    weights /= weights.sum()
    order = None
    if not whole:
        candidates = np.flatnonzero(weights >= (1.0 - top_p) / vocab)
        order = candidates[np.argsort(-logits[candidates], kind="stable")]  # (by id first: ties stay by id)
        if np.cumsum(weights[order])[-1] < top_p:
            order = None
    if order is None:
        order = np.argsort(-logits, kind="stable")
    ranked = weights[order]
    kept = np.zeros(vocab, dtype=bool)
    kept[order[(np.cumsum(ranked) - ranked) < top_p]] = True
    return kept


def choose_token(logits: np.ndarray, params: SamplingParams, context: Sequence[int], output_from: int,
                 generator: np.random.Generator) -> int:
    """The next token: the first maximum of the processed logits where params are greedy (numpy's
    argmax and torch's), else a draw from their softmax."""
    processed = processed_logits(logits, params, context, output_from)
    if params.greedy:
        return int(processed.argmax())
    return draw(np.exp(processed.astype(np.float64) - float(processed.max())), generator)


def probabilities(processed: np.ndarray) -> np.ndarray:
    """The distribution (V,) of processed logits, in float64: their softmax (a speculative
    round's p and a draft's q)."""
    weights = np.exp(processed.astype(np.float64) - float(processed.max()))
    return weights / weights.sum()


def draw(weights: np.ndarray, generator: np.random.Generator | None) -> int:
    """One index drawn in proportion to `weights` (V,), not all zero: the first whose cumulative
    weight exceeds a uniform draw of their total (a zero weight is never drawn); generator: the
    request's (None: a fresh one)."""
    generator = generator if generator is not None else seeded_generator(None)
    cumulative = np.cumsum(weights, dtype=np.float64)
    index = int(np.searchsorted(cumulative, generator.random() * cumulative[-1], side="right"))
    # (a draw that rounds up to the total itself: the last token of any weight)
    return index if index < len(cumulative) else int(np.flatnonzero(weights)[-1])
