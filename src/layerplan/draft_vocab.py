"""A draft-side LM head over a reduced vocabulary (frequency-ranked, as in FR-Spec).

The draft scores only the K most frequent tokens of calibration text, so its LM head costs
K/V of the full one; tokens outside the subset get probability 0 in the draft. The target still
verifies with the whole vocabulary, so output stays exactly the target's: a token the draft
cannot propose only lowers acceptance.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

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
    if len(keep) < k:  # the text had fewer distinct tokens than k: fill with the lowest ids
        keep.update(i for i in range(vocab) if len(keep) < k or i in keep)
    return torch.tensor(sorted(t for t in keep if 0 <= t < vocab), dtype=torch.long)


class ReducedHead:
    """Final norm + LM head restricted to `ids`; returns full-size logits with -inf elsewhere."""

    def __init__(self, model: LoadedModel, ids: torch.Tensor) -> None:
        parts = model.parts
        self.parts = parts
        self.vocab = model.hf.config.vocab_size
        self.ids = ids.to(model.device)
        weight = parts.lm_head.weight.detach()[self.ids].contiguous()  # (K, hidden)
        bias = getattr(parts.lm_head, "bias", None)
        self.bias = bias.detach()[self.ids] if bias is not None else None
        from layerplan.cpu_pack import packing_supported

        if packing_supported(weight.dtype, weight.device):  # same oneDNN packing as the model's own linears
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self.weight = None
        else:
            self.packed, self.weight = None, weight

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> logits (..., V), -inf outside the subset."""
        normed = self.parts.final_norm(hidden)
        if self.packed is not None:
            sub = torch.ops.mkldnn._linear_pointwise(normed, self.packed, self.bias, "none", [], "")
        else:
            sub = F.linear(normed, self.weight, self.bias)
        sub = softcap(self.parts, sub)
        full = torch.full((*sub.shape[:-1], self.vocab), float("-inf"), dtype=sub.dtype, device=sub.device)
        full[..., self.ids] = sub
        return full
