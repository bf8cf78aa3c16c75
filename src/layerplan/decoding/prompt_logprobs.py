"""A prompt's own tokens scored by the model: each token's logprob given the tokens before it, as
an OpenAI completion with `echo` and `logprobs` reports them (lm-evaluation-harness's
`local-completions` scores a continuation this way). The prompt runs through the plan in chunks
with a KV cache, so a long prompt holds one chunk's logits (chunk x vocabulary floats) at a time,
not the whole prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerplan.decoding.logprobs import TokenLogprob, token_logprob
from layerplan.engine.cache import KVCache
from layerplan.engine.runner import forward, new_cache
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan

CHUNK_TOKENS = 256  # a chunk's logits: 155 MB at Qwen's 151,936-token vocabulary


def prompt_logprobs(model: LoadedModel, ids: Sequence[int], plan: LayerPlan, top: int,
                    chunk: int = CHUNK_TOKENS, cache: KVCache | None = None) -> list[TokenLogprob]:
    """TokenLogprob of ids[1:], each given the ids before it under `plan`, with its `top` most likely
    alternatives (decoding/logprobs.py: the model's own distribution). The first token has no
    context, and so no entry; the last one's logits (the next token's) are not run. cache: an empty
    one of `plan`'s, which is left holding every token but the last (a decode of the prompt goes on
    from it: decoding/loop.py DecodeLoop's cache)."""
    ids = list(ids)
    scored: list[TokenLogprob] = []
    cache = cache if cache is not None else new_cache(plan, capacity=max(len(ids) - 1, 1))
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start: min(start + chunk, len(ids) - 1)]
            logits = forward(model, torch.tensor([piece], device=model.device), plan, cache, start)[0]
            scored.extend(token_logprob(logits[j], ids[start + j + 1], top) for j in range(len(piece)))
    return scored
