"""decoding/choice.py: a plain decode's next token from numpy logits. Greedy under a logit bias and
the penalties it is the torch front end's speculative rounds' token (decoding/sampling.py pick),
for every setting and many random rows, ties and -inf bans included; its processed logits for a
sample are sampling.py process_logits's; a draw follows the distribution and its seed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from layerplan.decoding.choice import choose_token, draw, processed_logits, seeded_generator, top_p_kept
from layerplan.decoding.sampling import penalty_context, pick, process_logits
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
def test_the_greedy_token_is_the_torch_front_ends(settings):
    params = SamplingParams(**settings)
    for trial, logits, context, output_from in _rows(0, 300):
        seen = penalty_context(context, params, "cpu", output_from=output_from)
        want = pick(torch.from_numpy(logits.copy()), params, seen, None)
        assert choose_token(logits, params, context, output_from, seeded_generator(0)) == want, (trial, settings)


@pytest.mark.parametrize("settings", SAMPLED, ids=lambda s: ",".join(s))
def test_a_samples_processed_logits_are_the_torch_front_ends(settings):
    """The same tokens kept (the same -inf), the same values within float32's rounding: the plain
    steps' distribution is the one speculative rounds verify against. (Rows without ties: where
    tied logits straddle top-p's boundary, which of them stays is each sort's own order.)"""
    params = SamplingParams(**settings)
    for trial, logits, context, output_from in _rows(1, 200):
        if trial % 5 == 0:
            continue
        seen = penalty_context(context, params, "cpu", output_from=output_from)
        want = process_logits(torch.from_numpy(logits.copy()), params, seen).numpy()
        ours = processed_logits(logits, params, context, output_from)
        assert np.array_equal(np.isinf(ours), np.isinf(want)), (trial, settings)
        kept = np.isfinite(want)
        np.testing.assert_allclose(ours[kept], want[kept], rtol=1e-6, atol=1e-6, err_msg=str((trial, settings)))


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
