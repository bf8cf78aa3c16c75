"""Prepacked oneDNN weights for bfloat16 linears on CPU (the same trick as IPEX's `optimize`).

A plain bf16 `F.linear` on CPU reorders its weight into oneDNN's blocked layout on every call;
at decode time (one row) that costs as much as the product itself. Packing once at load time makes
the model's linears ~1.6x faster here and gives bit-identical results (checked in the tests).

`pack_linears` swaps each `nn.Linear` child for a `PackedLinear` that keeps the very same weight
and bias Parameters (state_dict, tying and checkpoint export are unchanged) plus the packed copy,
so weights take twice the memory. Only this model instance changes; nothing global is patched.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """`nn.Linear` with its bf16 weight pre-reordered for oneDNN; same Parameters, same results."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter object: tying and state_dict keep working
        self.bias = linear.bias
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 `nn.Linear` inside `model` by a `PackedLinear`; return how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
