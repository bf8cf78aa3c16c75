"""A plain greedy decode on the light front end: decoding/generate.py's Decoding, token for token
(the prompt in one pass, then a pass a token; the first maximum of each row's logits), with the
same Emitter deciding what text streams and when it stops, and the same GenerationResult."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from layerplan.decoding.text import Emitter, GenerationResult
from layerplan.lite.model import LiteModel
from layerplan.plan.plan import LayerPlan


def generate(model: LiteModel, prompt_ids: Sequence[int], plan: LayerPlan, max_new_tokens: int,
             stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Greedy new tokens after `prompt_ids` (non-empty) through `plan`."""
    start = time.perf_counter()
    out = Emitter(model, max_new_tokens, stop, True, on_text)
    context = list(prompt_ids)
    cache = model.new_cache(plan, len(context) + max_new_tokens + 1)
    logits = model.logits(context, cache, 0)
    prefill_seconds = time.perf_counter() - start
    while True:
        token = int(logits[-1].argmax())  # numpy's first maximum, as decoding/sampling.py argmax_token
        context.append(token)
        out.emit([token])
        if out.done:
            break
        logits = model.logits([token], cache, len(context) - 1)
    text = out.finish()
    return GenerationResult(text, out.tokens, len(prompt_ids), out.reason, time.perf_counter() - start,
                            prefill_seconds, plan.to_string(), provenance=out.provenance(), pieces=out.stream.pieces())
