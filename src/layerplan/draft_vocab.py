"""A draft-side LM head over a reduced vocabulary (frequency-ranked, as in FR-Spec).

The draft scores only the K most frequent tokens of calibration text, so its LM head costs
K/V of the full one; tokens outside the subset get probability 0 in the draft. The target still
verifies with the whole vocabulary, so output stays exactly the target's: a token the draft
cannot propose only lowers acceptance.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from layerplan.models import LoadedModel
from layerplan.runner import softcap


def frequent_tokens(model: LoadedModel, k: int, text: str | None = None) -> torch.Tensor:
    """The k most frequent token ids of `text` (default: the built-in corpus), plus the special
    tokens (EOS must stay proposable), sorted."""
    from layerplan.corpus import default_corpus

    vocab = model.hf.config.vocab_size
    if model.tokenizer is None:
        raise ValueError("a reduced draft vocabulary is counted on text, and this model has no tokenizer")
    if not 1 <= k <= vocab:
        raise ValueError(f"a reduced draft vocabulary needs 1 <= K <= {vocab}, got {k}")
    counts = Counter(model.tokenizer.encode(text if text is not None else default_corpus(), add_special_tokens=False))
    keep = {t for t, _ in counts.most_common(k)}
    keep.update(model.eos_token_ids)
    for special in model.tokenizer.all_special_ids:
        keep.add(int(special))
    for i in range(vocab):  # the text had fewer distinct tokens than k: fill with the lowest ids
        if len(keep) >= k:
            break
        keep.add(i)
    return torch.tensor(sorted(t for t in keep if 0 <= t < vocab), dtype=torch.long)


class ReducedHead:
    """Final norm + LM head restricted to `ids`; returns full-size logits with -inf elsewhere."""

    def __init__(self, model: LoadedModel, ids: torch.Tensor) -> None:
        from layerplan.cpu_pack import PackedLinear, packing_supported

        parts = model.parts
        self.parts = parts
        self.vocab = model.hf.config.vocab_size
        self.ids = ids.to(model.device)
        full = parts.lm_head
        bias = getattr(full, "bias", None)
        linear = nn.Linear(full.weight.shape[1], len(self.ids), bias=bias is not None,
                           dtype=full.weight.dtype, device=full.weight.device)
        linear.weight = nn.Parameter(full.weight.detach()[self.ids].contiguous(), requires_grad=False)  # (K, H)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach()[self.ids], requires_grad=False)
        # the same oneDNN packing as the model's own linears, where it applies
        self.linear = PackedLinear(linear) if packing_supported(linear.weight.dtype, linear.weight.device) else linear

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> logits (..., V), -inf outside the subset."""
        sub = softcap(self.parts, self.linear(self.parts.final_norm(hidden)))
        full = torch.full((*sub.shape[:-1], self.vocab), float("-inf"), dtype=sub.dtype, device=sub.device)
        full[..., self.ids] = sub
        return full


def reduced_head(model: LoadedModel, k: int, text: str | None = None) -> ReducedHead:
    """A ReducedHead over the k most frequent tokens of `text` (default: the built-in corpus)."""
    return ReducedHead(model, frequent_tokens(model, k, text))
