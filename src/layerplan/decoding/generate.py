"""Generation through a plan: prefill the prompt, then one token per step; with a draft, the
speculative loop (speculative.py) instead."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from layerplan.decoding.drafters.dynamic_exit import DynamicExit, ExitPolicy
from layerplan.decoding.output import Emitter, GenerationResult, prompt_ids
from layerplan.decoding.sampling import SamplingParams, pick
from layerplan.decoding.speculative import speculative_generate
from layerplan.engine.probe import PaceCheck, ProbeRow
from layerplan.engine.runner import forward, new_cache
from layerplan.models.loading import LoadedModel
from layerplan.plan.plan import LayerPlan


@torch.inference_mode()
def generate(
    model: LoadedModel,
    prompt: str | torch.Tensor | Sequence[int],
    plan: LayerPlan | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_at_eos: bool | Sequence[int] = True,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    draft=None,
    draft_length=None,
    draft_confidence: float = 0.0,
    should_stop: Callable[[], bool] | None = None,
    exit_policy=None,
    probe_row: ProbeRow | None = None,
) -> GenerationResult:
    """Generate with the model run by `plan` (the full model by default).

    exit_policy: dynamic early exit per token (an ExitPolicy or its text, e.g.
    "confidence=0.9,min=12"; see drafters/dynamic_exit.py). Lossy, like any plan that is not the full
    model; the prompt always runs through the whole plan.

    draft: a drafter (or its name, e.g. "ngram", "exit:8", "skip:attn=3,5") makes this lossless
    speculative decoding: same greedy output, same sampling distribution (see speculative.py).

    probe_row: this machine's probe row for the model (engine/probe.py checked_model_row): the
    decode compares its passes with it (result.slow_note), and a speculative one takes its verify
    costs from it; None: no comparison, and verify costs learned from the passes seen."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if draft is not None and exit_policy is not None:
        raise ValueError("exit_policy makes generation lossy; as a lossless draft use draft='dynamic:POLICY'")
    if draft is not None:
        return speculative_generate(model, prompt, draft, plan, max_new_tokens, sampling, seed, stop,
                                    stop_at_eos, chat, on_text, draft_length, draft_confidence, should_stop,
                                    probe_row)
    plan = plan if plan is not None else model.plan()
    sampling = sampling or SamplingParams()
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    ids = prompt_ids(model, prompt, chat)
    out = Emitter(model, max_new_tokens, stop, stop_at_eos, on_text, should_stop)
    pace = PaceCheck(probe_row)

    start = time.perf_counter()
    cache = new_cache(plan, capacity=ids.shape[1] + max_new_tokens + 1)
    logits = forward(model, ids, plan, cache, 0, last_only=True)[0, -1]
    prefill = time.perf_counter() - start
    dynamic = None
    if exit_policy is not None:
        policy = ExitPolicy.parse(exit_policy) if isinstance(exit_policy, str) else exit_policy
        dynamic = DynamicExit(model, plan, policy)
    context = ids[0].tolist()
    while not out.done:
        seen = torch.tensor(context, device=logits.device) if sampling.repetition_penalty != 1.0 else None
        token = pick(logits, sampling, seen, generator)
        context.append(token)
        out.emit([token])
        if not out.done:
            step_start = time.perf_counter()
            if dynamic is not None:
                logits = dynamic(token, cache, len(context) - 1, propagate=True)
            else:
                step = torch.tensor([[token]], device=ids.device)
                logits = forward(model, step, plan, cache, len(context) - 1, last_only=True)[0, -1]
            pace.add(1, time.perf_counter() - step_start)
    elapsed = time.perf_counter() - start
    text = out.finish()
    return GenerationResult(text, out.tokens, ids.shape[1], out.reason, elapsed, prefill, plan.to_string(),
                            stats=dynamic.stats() if dynamic is not None else {}, slow_note=pace.note())
