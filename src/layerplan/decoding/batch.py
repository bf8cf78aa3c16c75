"""Several generations at once (continuous batching): each request's decode is a
generate.Decoding (plain) or a speculative.SpeculativeDecoding (its own drafter, draft length and
acceptance), and a step
runs every active one's next pass (its pending token, and its drafted chain) as one pass
(runner.forward_batch), whose products the requests share. A request's tokens are those of its
own generate() call, bit for bit: the kernels' rows do not depend on the other rows of a pass,
and each request keeps its own cache, positions, sampler and seed. Requests join after their
prefill and leave when done. The rows of a pass are budgeted (ROW_BUDGET): the more requests, the
shorter each one's drafts, since a pass's cost grows with its rows."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from layerplan.decoding.generate import Decoding
from layerplan.decoding.output import GenerationResult
from layerplan.decoding.sampling import SamplingParams
from layerplan.decoding.speculative import SpeculativeDecoding
from layerplan.engine.runner import forward_batch
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan

# the rows a batch's pass carries at most, drafts included: one request drafts up to its policy's
# length, 4 up to 3 tokens each, 8 one each (what an 8-16-row pass costs over one row on a CPU)
ROW_BUDGET = 16


def prefill_all(model: LoadedModel, plan: LayerPlan, joining: Sequence[Decoding | SpeculativeDecoding]) -> None:
    """The prompts of the decodes that join, in one pass (the head on each one's last row only),
    and each one's first token."""
    sequences = [(d.ids, d.cache, 0) for d in joining]
    for decoding, logits in zip(joining, forward_batch(model, sequences, plan, last_only=True)):
        decoding.prefilled(logits[-1])


def step_all(model: LoadedModel, plan: LayerPlan, active: Sequence[Decoding | SpeculativeDecoding]) -> None:
    """The next pass of every active decode (a token each, and the drafts' chains within the row
    budget), in one pass."""
    cap = max(ROW_BUDGET // max(len(active), 1) - 1, 0)
    passes = [d.next_pass(cap) for d in active]
    start = time.perf_counter()
    every = forward_batch(model, passes, plan)
    seconds, rows = time.perf_counter() - start, sum(ids.shape[1] for ids, _, _ in passes)
    for decoding, logits in zip(active, every):
        if isinstance(decoding, Decoding):
            decoding.take_pass(logits, rows, seconds)
        else:  # a speculative round times its own verify
            decoding.take_pass(logits)


@torch.inference_mode()
def generate_batch(model: LoadedModel, prompts: Sequence, plan: LayerPlan | None = None, max_new_tokens: int = 64,
                   sampling: SamplingParams | None = None, seeds: Sequence[int | None] | None = None,
                   stop: Sequence[str] = (), stop_at_eos: bool | Sequence[int] = True, chat: bool = False,
                   max_batch: int = 8, draft: str | None = None, draft_length=None) -> list[GenerationResult]:
    """generate() for every prompt, up to max_batch decoding at once (continuous batching): a
    prompt starts as soon as one ends. Each result is its prompt's generate() result, token for
    token (greedy, or sampled with its seed). draft: each prompt drafts with its own drafter of
    this spec (lossless: the same tokens), its chains verified in the batch's passes."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    plan = plan if plan is not None else model.plan()
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    waiting = deque(range(len(prompts)))
    results: list[GenerationResult | None] = [None] * len(prompts)
    active: list[tuple[int, Decoding]] = []
    while waiting or active:
        joining = []
        while waiting and len(active) + len(joining) < max_batch:
            index = waiting.popleft()
            if draft is None:
                decoding = Decoding(model, prompts[index], plan, max_new_tokens, sampling, seeds[index], stop,
                                    stop_at_eos, chat)
            else:
                decoding = SpeculativeDecoding(model, prompts[index], draft, plan, max_new_tokens, sampling,
                                               seeds[index], stop, stop_at_eos, chat, draft_length=draft_length)
            joining.append((index, decoding))
        if joining:
            prefill_all(model, plan, [d for _, d in joining])
            for index, decoding in joining:
                if decoding.done:
                    results[index] = decoding.result()
                else:
                    active.append((index, decoding))
        if active:
            step_all(model, plan, [d for _, d in active])
            for index, decoding in [(i, d) for i, d in active if d.done]:
                results[index] = decoding.result()
            active = [(i, d) for i, d in active if not d.done]
    return results
