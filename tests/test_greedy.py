"""decoding/greedy.py: the greedy token under a logit bias and the penalties, on numpy logits, is
the torch front end's (decoding/sampling.py pick) for every setting and many random rows, ties
and -inf bans included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from layerplan.decoding.greedy import greedy_token
from layerplan.decoding.sampling import penalty_context, pick
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


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s) or "none")
def test_the_greedy_token_is_the_torch_front_ends(settings):
    params = SamplingParams(**settings)
    generator = np.random.default_rng(0)
    for trial in range(300):
        vocab = int(generator.integers(16, 64))
        logits = generator.normal(0, 3, vocab).astype(np.float32)
        if trial % 5 == 0:  # ties: the first maximum either way
            logits[generator.integers(0, vocab, 4)] = logits.max()
        context = generator.integers(0, vocab, int(generator.integers(1, 20))).tolist()
        output_from = int(generator.integers(0, len(context) + 1))
        seen = penalty_context(context, params, "cpu", output_from=output_from)
        want = pick(torch.from_numpy(logits.copy()), params, seen, None)
        assert greedy_token(logits, params, context, output_from) == want, (trial, settings)
