"""Greedy choice under a logit bias and the penalties, on numpy logits, without torch: what
decoding/sampling.py process_logits and argmax_token give for a greedy SamplingParams, op for op in
float32 (the bias added, then the repetition penalty on the context's tokens, then presence and
frequency on the generated ones), so that the light front end's tokens are the torch front end's
(tests/test_greedy.py holds them to it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from layerplan.decoding.sampling_params import SamplingParams


def greedy_token(logits: np.ndarray, params: SamplingParams, context: Sequence[int], output_from: int) -> int:
    """The first maximum of the logits (V,) once params' logit bias and penalties are applied;
    context: the tokens so far, those from output_from on generated (the presence and frequency
    penalties' count)."""
    processed = np.array(logits, dtype=np.float32)  # (a copy: the caller's row stays as it is)
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
    return int(processed.argmax())
