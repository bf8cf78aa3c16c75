"""Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty.

`next_token_probs` is the single definition of the distribution a decoder samples from; the
speculative decoder applies it to draft and target logits alike, so q and p are processed the
same way (the point transformers got wrong).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from layerplan.decoding.sampling_params import SamplingParams


@dataclass(frozen=True)
class Seen:
    """The tokens the penalties look at: the whole context (the repetition penalty's, prompt
    included, as transformers counts it) and the tokens generated so far (presence and frequency,
    as OpenAI and vLLM count them)."""

    context: torch.Tensor  # 1-D token ids
    output: torch.Tensor  # 1-D token ids: context[output_from:]


def penalty_context(context: Sequence[int], params: SamplingParams, device, output_from: int = 0) -> Seen | None:
    """What the penalties look at in `context`, whose tokens from `output_from` on were generated
    (None where no penalty is set)."""
    if params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty:
        return None
    tokens = torch.tensor(list(context), dtype=torch.long, device=device)
    return Seen(tokens, tokens[output_from:])


def apply_output_penalties(logits: torch.Tensor, output: torch.Tensor, presence: float,
                           frequency: float) -> torch.Tensor:
    """logits (V,) less presence where a token was generated and frequency times its count."""
    if (not presence and not frequency) or output.numel() == 0:
        return logits
    counts = torch.bincount(output, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """logits (V,); seen: 1-D token ids already in the context."""
    if penalty == 1.0 or seen is None or seen.numel() == 0:
        return logits
    ids = torch.unique(seen)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def argmax_token(logits: torch.Tensor) -> int:
    """The index of the first maximum of logits (V,), a NaN counting as the maximum: torch's rule,
    which numpy's argmax follows too. On a CPU float32 row numpy's skips the dispatch of torch's
    parallel reduction, which costs far more than the scan itself at a vocabulary's length (and
    is paid for every token of every request)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """logits (V,) float32 with each (token, bias) added (a copy where there is any)."""
    if not bias:
        return logits
    tokens = torch.tensor([token for token, _ in bias], device=logits.device)
    return logits.index_add(0, tokens, torch.tensor([value for _, value in bias], device=logits.device))


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: Seen | None = None) -> torch.Tensor:
    """Processed logits (V,) in float32: logit bias, the penalties (repetition, then presence and
    frequency), temperature, then top-k / top-p / min-p masking (-inf)."""
    logits = apply_logit_bias(logits.float(), params.logit_bias)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen.context, params.repetition_penalty)
        logits = apply_output_penalties(logits, seen.output, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return logits
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, -1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:  # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        logits = logits.masked_fill(logits < logits.max() + math.log(params.min_p), float("-inf"))
    return logits


def next_token_probs(logits: torch.Tensor, params: SamplingParams, seen: Seen | None = None) -> torch.Tensor:
    """The distribution (V,) the decoder draws from; one-hot at the argmax when greedy."""
    processed = process_logits(logits, params, seen)
    if params.greedy:
        return torch.nn.functional.one_hot(torch.tensor(argmax_token(processed)), processed.shape[-1]).float()
    return torch.softmax(processed, -1)


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from probs (V,) on the CPU, where a request's generator is: a seed gives the
    same tokens whatever device the logits came from. Every random token is drawn here."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def pick(logits: torch.Tensor, params: SamplingParams, seen: Seen | None, generator: torch.Generator | None) -> int:
    """One next token from logits (V,)."""
    processed = process_logits(logits, params, seen)
    if params.greedy:
        return argmax_token(processed)
    return draw_token(torch.softmax(processed, -1), generator)
