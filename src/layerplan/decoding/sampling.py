"""Turning logits into the next token: greedy, temperature, top-k, top-p, repetition penalty.

`next_token_probs` is the single definition of the distribution a decoder samples from; the
speculative decoder applies it to draft and target logits alike, so q and p are processed the
same way (the point transformers got wrong).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    repetition_penalty: float = 1.0  # CTRL-style: divide positive / multiply negative logits of seen tokens

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """logits (V,); seen: 1-D token ids already in the context."""
    if penalty == 1.0 or seen is None or seen.numel() == 0:
        return logits
    ids = torch.unique(seen)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits (V,) in float32: penalty, temperature, then top-k / top-p masking (-inf)."""
    logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
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
    return logits


def next_token_probs(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution (V,) the decoder draws from; one-hot at the argmax when greedy."""
    processed = process_logits(logits, params, seen)
    if params.greedy:
        return torch.nn.functional.one_hot(processed.argmax(), processed.shape[-1]).float()
    return torch.softmax(processed, -1)


def pick(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None, generator: torch.Generator | None) -> int:
    """One next token from logits (V,)."""
    processed = process_logits(logits, params, seen)
    if params.greedy:
        return int(processed.argmax())
    return int(torch.multinomial(torch.softmax(processed, -1), 1, generator=generator))
