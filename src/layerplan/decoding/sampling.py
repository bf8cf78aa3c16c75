"""Turning a speculative round's torch logits into tokens and distributions: the verify rows'
picks and p, a draft's q. The logits are processed by decoding/choice.py, the one definition every
plain step takes too (numpy, on the CPU; the result back on the logits' device), so a round's p
is exactly the distribution a plain step samples from, and the draft's q goes through the same
processing as the target's p (the point transformers got wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from layerplan.decoding.choice import draw, processed_logits
from layerplan.decoding.sampling_params import SamplingParams


@dataclass(frozen=True)
class Seen:
    """The tokens the penalties look at: the whole context (the repetition penalty's, prompt
    included, as transformers counts it), of which those from output_from on were generated
    (presence and frequency, as OpenAI and vLLM count them)."""

    context: list[int]
    output_from: int = 0


def penalty_context(context: Sequence[int], params: SamplingParams, output_from: int = 0) -> Seen | None:
    """What the penalties look at in `context`, whose tokens from `output_from` on were generated
    (None where no penalty is set)."""
    if params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty:
        return None
    return Seen(list(context), output_from)


def argmax_token(logits: torch.Tensor) -> int:
    """The index of the first maximum of logits (V,), a NaN counting as the maximum: torch's rule,
    which numpy's argmax follows too. On a CPU float32 row numpy's skips the dispatch of torch's
    parallel reduction, which costs far more than the scan itself at a vocabulary's length (and
    is paid for every token of every request)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: Seen | None = None) -> torch.Tensor:
    """Processed logits (V,) in float32 on the logits' device: decoding/choice.py processed_logits
    (logit bias, the penalties, temperature, then top-k / top-p / min-p masking to -inf)."""
    row = logits.detach().float().cpu().numpy()
    processed = processed_logits(row, params, seen.context if seen is not None else (),
                                 seen.output_from if seen is not None else 0)
    return torch.from_numpy(processed).to(logits.device)


def next_token_probs(logits: torch.Tensor, params: SamplingParams, seen: Seen | None = None) -> torch.Tensor:
    """The distribution (V,) the decoder draws from; one-hot at the argmax when greedy."""
    processed = process_logits(logits, params, seen)
    if params.greedy:
        return torch.nn.functional.one_hot(torch.tensor(argmax_token(processed)), processed.shape[-1]).float()
    return torch.softmax(processed, -1)


def draw_token(weights: torch.Tensor, generator: np.random.Generator | None) -> int:
    """One token drawn in proportion to weights (V,) by decoding/choice.py's draw, from the
    request's generator (None: a fresh one): a seed gives the same tokens whatever device the
    logits came from. Every random token is drawn by that one rule (a plain step's in choice.py)."""
    return draw(weights.detach().double().cpu().numpy(), generator)


def greedy_pick(logits: torch.Tensor, params: SamplingParams, seen: Seen | None) -> int:
    """A greedy target's token from logits (V,): the first maximum once params' logit bias and
    penalties are applied (a speculative round's picks; plain steps: decoding/choice.py)."""
    return argmax_token(process_logits(logits, params, seen))
