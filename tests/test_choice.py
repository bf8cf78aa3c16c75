"""decoding/choice.py: a plain decode's next token from numpy logits, and the processing a
speculative round's rows take too (rounds.py target_pick). Greedy under a logit bias and the
penalties, the round's pick is the plain step's token; a sample's processed logits
keep what a plain reference of temperature, top-k, top-p and min-p keeps; top-p's candidates
give the whole sort's answer; a draw follows the distribution and its seed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from layerplan.decoding.choice import choose_token, draw, processed_logits, seeded_generator, top_p_kept
from layerplan.decoding.rounds import target_pick
from layerplan.decoding.sampling_params import SamplingParams

SETTINGS = [
    {},
    {"logit_bias": ((3, 5.0), (7, -math.inf), (3, 0.5))},  # (a token named twice: both added)
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8, "presence_penalty": -0.4},
    {"logit_bias": ((11, 2.0),), "repetition_penalty": 1.2, "presence_penalty": 0.6, "frequency_penalty": 0.3},
]
SAMPLED = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2,
     "presence_penalty": 0.5, "logit_bias": ((3, -math.inf),)},
]


def _rows(seed: int, count: int):
    generator = np.random.default_rng(seed)
    for trial in range(count):
        vocab = int(generator.integers(16, 64))
        logits = generator.normal(0, 3, vocab).astype(np.float32)
        if trial % 5 == 0:  # ties: the first maximum either way
            logits[generator.integers(0, vocab, 4)] = logits.max()
        context = generator.integers(0, vocab, int(generator.integers(1, 20))).tolist()
        yield trial, logits, context, int(generator.integers(0, len(context) + 1))


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s) or "none")
def test_a_rounds_greedy_pick_is_the_plain_steps_token(settings):
    """The first maximum (ties: the first) after the bias and the penalties, on the rows a
    speculative round verifies as on a plain step's row."""
    params = SamplingParams(**settings)
    for trial, logits, context, output_from in _rows(0, 300):
        want = target_pick(logits, params, context, output_from)
        assert choose_token(logits, params, context, output_from, seeded_generator(0)) == want, (trial, settings)
        reference = _penalised(logits, params, context, output_from)
        assert want == reference.index(max(reference)), (trial, settings)


def _penalised(logits, params: SamplingParams, context, output_from) -> list[float]:
    """The bias and the penalties in plain float64 Python (OpenAI's and transformers' rules)."""
    values = [float(v) for v in logits]
    for token, bias in params.logit_bias:
        values[token] += bias
    for token in set(context):
        if params.repetition_penalty != 1.0:
            values[token] = values[token] / params.repetition_penalty if values[token] > 0 \
                else values[token] * params.repetition_penalty
    output = context[output_from:]
    for token in set(output):
        values[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return values


def _kept(logits, params: SamplingParams) -> set[int]:
    """The tokens temperature, top-k, top-p and min-p keep, in plain float64 Python."""
    values = [float(v) / params.temperature for v in logits]
    if params.top_k and params.top_k < len(values):
        kth = sorted(values, reverse=True)[params.top_k - 1]
        values = [v if v >= kth else -math.inf for v in values]
    if params.top_p < 1.0:
        top = max(values)
        weights = [math.exp(v - top) for v in values]
        total = sum(weights)
        running, kept = 0.0, set()
        for i in sorted(range(len(values)), key=lambda i: (-values[i], i)):
            if running >= params.top_p:
                break
            kept.add(i)
            running += weights[i] / total
        values = [v if i in kept else -math.inf for i, v in enumerate(values)]
    if params.min_p > 0.0:
        floor = max(values) + math.log(params.min_p)
        values = [v if v >= floor else -math.inf for v in values]
    return {i for i, v in enumerate(values) if v > -math.inf}


@pytest.mark.parametrize("settings", SAMPLED[:-1], ids=lambda s: ",".join(s))
def test_a_samples_processed_logits_keep_what_the_plain_rules_keep(settings):
    """The same tokens kept as the rules written out plainly (rows without ties: where tied logits
    straddle a boundary, which stays is the order's), the kept ones' values the logits over the
    temperature."""
    params = SamplingParams(**settings)
    for trial, logits, _, _ in _rows(1, 200):
        if trial % 5 == 0:
            continue
        ours = processed_logits(logits, params, [], 0)
        assert {int(i) for i in np.flatnonzero(np.isfinite(ours))} == _kept(logits, params), (trial, settings)
        kept = np.isfinite(ours)
        np.testing.assert_allclose(ours[kept], logits[kept] / np.float32(params.temperature), rtol=1e-6)


def test_draws_follow_the_distribution_and_the_seed():
    """A chi-square test (seeded) of 20,000 draws over a distribution with zero weights, which are
    never drawn; the same seed draws the same tokens, a negative seed as torch takes it too."""
    weights = np.array([0.0, 0.5, 0.0, 2.0, 1.0, 0.25, 0.0, 4.0])
    generator = seeded_generator(12)
    counts = np.bincount([draw(weights, generator) for _ in range(20_000)], minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    expected = weights[weights > 0] / weights.sum() * counts.sum()
    assert stats.chisquare(counts[weights > 0], expected).pvalue > 1e-3
    for seed in (0, 7, -5, 2 ** 64 - 1):
        first, second = seeded_generator(seed), seeded_generator(seed)
        assert [draw(weights, first) for _ in range(50)] == [draw(weights, second) for _ in range(50)]


def test_a_sampled_choice_keeps_to_the_tokens_its_settings_keep():
    logits = np.array([5.0, 4.9, 1.0, 0.0, -1.0], dtype=np.float32)
    generator = seeded_generator(3)
    for settings, allowed in (({"top_k": 2}, {0, 1}), ({"min_p": 0.5}, {0, 1}), ({"top_p": 0.01}, {0}),
                              ({"logit_bias": ((0, -math.inf),), "top_k": 1}, {1})):
        params = SamplingParams(temperature=1.0, **settings)
        assert {choose_token(logits, params, [], 0, generator) for _ in range(200)} <= allowed, settings


def test_top_p_sorts_only_its_candidates_and_keeps_what_the_whole_sort_keeps():
    """top_p_kept's candidates (probability >= (1 - top_p) / V) give the whole sort's answer on
    flat, peaky, tied and partly banned rows, for top_p near 0, in between and near 1."""
    generator = np.random.default_rng(5)
    for trial in range(300):
        vocab = int(generator.integers(2, 3000))
        logits = generator.normal(0, float(generator.choice([0.1, 1.0, 4.0, 12.0])), vocab).astype(np.float32)
        if trial % 3 == 0:  # ties
            logits[generator.integers(0, vocab, vocab // 3 + 1)] = np.float32(generator.choice(logits))
        if trial % 4 == 0:  # banned tokens (a top-k before it)
            logits[generator.random(vocab) < 0.7] = -np.inf
            logits[int(generator.integers(0, vocab))] = 1.0
        for top_p in (1e-6, float(generator.random()), 0.95, 0.999999):
            assert np.array_equal(top_p_kept(logits, top_p), top_p_kept(logits, top_p, whole=True)), (trial, top_p)
