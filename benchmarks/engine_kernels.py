"""The native matrix product against PyTorch's F.linear, per number of rows (tokens in a pass),
and the two rates that bound a pass: the memory bandwidth the machine gives (what a decoding
step, reading every weight once, can cost) and the fp32 arithmetic rate of a cache-resident
matrix product in MKL (what a pass over many tokens, 2 FLOP per weight per token, can cost).

    python benchmarks/engine_kernels.py [--threads 1 2] [--repeats 50]

Shapes: SmolLM2-135M's MLP up-projection (1536x576, cache-resident after the first call) and its
LM head (49152x576, 57 MB in bf16: read from memory on every call).
"""

from __future__ import annotations

import argparse

import torch

from layerplan.engine import native
from layerplan.machine import cpu_info
from timing import median_ms

ROWS = (1, 2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    reason = native.native_available()
    if reason is not None:
        raise SystemExit(reason)
    generator = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(cpu_info().line())
        big = torch.ones(135_000_000, dtype=torch.bfloat16)
        ms = median_ms(lambda: big.sum(), 10)
        print(f"  memory: sum() over 270 MB of bf16 in {ms:.1f} ms = {0.27 / ms * 1e3:.1f} GB/s")
        del big
        a, b = torch.randn(256, 576, generator=generator), torch.randn(576, 1536, generator=generator)
        ms = median_ms(lambda: torch.mm(a, b), 50, warmup=5)
        print(f"  arithmetic: fp32 torch.mm 256x576 @ 576x1536 (cache-resident) in {ms * 1e3:.0f} us = "
              f"{2 * 256 * 576 * 1536 / ms / 1e6:.0f} GFLOP/s")
        for name, (n, k) in {"mlp up 1536x576": (1536, 576), "lm head 49152x576": (49152, 576)}.items():
            for dtype in (torch.bfloat16, torch.float32):
                weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
                packed = native.PackedMatrix([weight], [None])
                repeats = args.repeats if n < 10_000 else max(5, args.repeats // 5)
                cells = []
                for rows in ROWS:
                    x = torch.randn(rows, k, generator=generator).to(dtype)
                    ours = median_ms(lambda: packed(x), repeats, warmup=3)
                    torch_ms = median_ms(lambda: torch.nn.functional.linear(x, weight), repeats, warmup=3)
                    unit, scale = ("us", 1e3) if n < 10_000 else ("ms", 1.0)
                    rate = f" ({2 * rows * n * k / ours / 1e6:.0f} GFLOP/s)" if rows >= 8 else ""
                    cells.append(f"{rows:>2} rows {ours * scale:7.1f} / {torch_ms * scale:7.1f} {unit}{rate}")
                print(f"  {name} {str(dtype).replace('torch.', ''):<8} native / torch: " + "; ".join(cells))


if __name__ == "__main__":
    main()
