"""Kernel-level figures quoted in docs/how-it-works.md and docs/lab/, in one run.

    python benchmarks/kernels.py

1. bf16 linear on one row: stock F.linear against oneDNN-prepacked weights (cpu_pack.py), µs per
   call, and whether the results are bit-identical.
2. SmolLM2 in bf16 and fp32: the largest logit difference between decoding 4 tokens as one chunk
   (a speculative verify pass) and one at a time (plain decoding).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from layerplan.engine.runner import forward, new_cache
from layerplan.engine.load import load_model


def per_call_us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    for out_features, in_features in [(1536, 576), (576, 1536), (49152, 576)]:
        weight = torch.randn(out_features, in_features).bfloat16()
        x = torch.randn(1, in_features).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        plain = per_call_us(lambda: F.linear(x, weight))
        fast = per_call_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        same = torch.equal(F.linear(x, weight), torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        print(f"linear {out_features}x{in_features} bf16, 1 row: stock {plain:.1f} us, packed {fast:.1f} us, "
              f"identical {same}")
    for dtype in ("float32", "bfloat16"):
        model = load_model("smollm2", dtype=dtype)
        ids = model.encode('def binary_search(items, target):\n    """Return the index of target, or -1."""\n')
        plan, length = model.plan(), ids.shape[1]
        chunked, single = new_cache(plan), new_cache(plan)
        forward(model, ids[:, : length - 4], plan, chunked, 0)
        forward(model, ids[:, : length - 4], plan, single, 0)
        a = forward(model, ids[:, length - 4 :], plan, chunked, length - 4)
        b = torch.cat([forward(model, ids[:, t : t + 1], plan, single, t) for t in range(length - 4, length)], 1)
        print(f"SmolLM2 {dtype}: 4-token chunk vs one at a time, max logit difference "
              f"{(a.float() - b.float()).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
