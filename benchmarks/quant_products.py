"""Products over the GGUF block formats against fp32 and bf16: how fast one row reads the packed
weights, and what 8 rows cost against one.

    python benchmarks/quant_products.py [--mb 320] [--threads 2] [--rounds 7] [--formats Q4_1,...]
                                        [--arithmetic exact,int8] [--rows 4,8,16]

Each format gets one matrix of k = 4096 inputs and about --mb MB packed, filled with random blocks
with sane scales; all are made first, then each round times every format in turn (one row, then
the --rows passes), so a change in the machine's load falls on every format alike, and the other formats'
matrices push each one out of the caches between its products. --arithmetic int8 times the integer
products on quantized activations (kernels.h LP_ARITH_INT8; a format without them runs exact). A figure is the best of the
rounds: one row's GB/s of packed bytes (and G weights/s), then the time of each --rows pass (8) over one row's.
Figures on a machine shared with other work are indicative only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

import numpy as np

from layerplan.engine import kernel_library as kl
from layerplan.machine import read_cpuinfo

# format: (inputs a block, bytes a block, where its f16 scales lie in a block)
FORMATS = {
    "F32": (1, 4, []), "BF16": (1, 2, []), "F16": (1, 2, []),
    "Q8_0": (32, 34, [(0, 1)]), "Q4_0": (32, 18, [(0, 1)]), "Q4_1": (32, 20, [(0, 2)]),
    "Q5_0": (32, 22, [(0, 1)]), "Q5_1": (32, 24, [(0, 2)]), "Q2_K": (256, 84, [(80, 2)]),
    "Q3_K": (256, 110, [(108, 1)]), "Q4_K": (256, 144, [(0, 2)]), "Q5_K": (256, 176, [(0, 2)]),
    "Q6_K": (256, 210, [(208, 1)]),
}


def stored(name: str, n: int, k: int, rng) -> np.ndarray:
    block, nbytes, scales = FORMATS[name]
    if name == "F32":
        return rng.standard_normal((n, k), dtype=np.float32).view(np.uint8)
    if name in ("BF16", "F16"):
        values = rng.standard_normal((n, k), dtype=np.float32)
        halves = values.astype(np.float16) if name == "F16" else (values.view(np.uint32) >> 16).astype(np.uint16)
        return halves.view(np.uint8)
    rows = rng.integers(0, 256, (n * k // block, nbytes), dtype=np.uint8)
    for offset, count in scales:
        rows[:, offset:offset + 2 * count] = np.array([0x1c00], np.uint16).view(np.uint8).tolist() * count
    return rows.reshape(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=320.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--arithmetic", default="exact", help="exact, int8 or both (exact,int8)")
    parser.add_argument("--rows", default="8", help="the passes timed against one row: row counts, e.g. 4,8,16")
    args = parser.parse_args()
    passes = [int(r) for r in args.rows.split(",")]
    lib, abi = kl.library(), kl.ABI
    model, _ = read_cpuinfo()
    print(f"{model}; {os.cpu_count()} CPUs, {args.threads} threads; load average {os.getloadavg()[0]:.1f} "
          f"(a shared machine: indicative figures); kernels {lib.isa}")
    arithmetics = {"exact": abi.LP_ARITH_EXACT, "int8": abi.LP_ARITH_INT8}
    asked = args.arithmetic.split(",")
    print(f"{'format':11} {'MB':>6} {'1 row ms':>9} {'GB/s':>6} {'Gw/s':>6}"
          + "".join(f" {f'{m} rows ms':>10} {f'{m} / 1':>6}" for m in passes))
    rng = np.random.default_rng(0)
    k = args.k
    matrices = {}
    for name in args.formats.split(","):
        block, nbytes, _ = FORMATS[name]
        fmt = abi.constants[f"LP_FORMAT_{name}"]
        n = max(16, int(args.mb * 1e6 / (k // block * nbytes)) // 16 * 16)
        rows = stored(name, n, k, rng)
        size = lib.lp_packed_bytes(fmt, n, k)
        packed = np.empty(size + 64, np.uint8)
        at = (-packed.ctypes.data) % 64
        packed = packed[at:at + size]
        kl.check(lib.lp_pack(ctypes.c_void_p(rows.ctypes.data), fmt, n, k, ctypes.c_void_p(packed.ctypes.data)), "pack")
        for arithmetic in asked:
            label = name if len(asked) == 1 else f"{name} {arithmetic}"
            matrices[label] = (packed, abi.structs["lp_matrix"](ctypes.c_void_p(packed.ctypes.data), None, n, k, fmt,
                                                                arithmetics[arithmetic]))
        del rows
    x = rng.standard_normal((max(passes), k), dtype=np.float32)
    y = np.empty((max(passes), max(m.n for _, m in matrices.values())), np.float32)

    def seconds(matrix, m: int) -> float:
        start = time.perf_counter()
        kl.check(lib.lp_linear(ctypes.c_void_p(x.ctypes.data), abi.LP_DTYPE_F32, ctypes.byref(matrix),
                               ctypes.c_void_p(y.ctypes.data), abi.LP_DTYPE_F32, m, args.threads), "product")
        return time.perf_counter() - start

    best = {name: {m: float("inf") for m in [1, *passes]} for name in matrices}
    for _ in range(args.rounds):
        for name, (_, matrix) in matrices.items():
            for m in best[name]:
                best[name][m] = min(best[name][m], seconds(matrix, m))
    for name, (packed, matrix) in matrices.items():
        one = best[name][1]
        print(f"{name:11} {packed.size / 1e6:6.0f} {one * 1e3:9.2f} {packed.size / one / 1e9:6.1f} "
              f"{matrix.n * k / one / 1e9:6.2f}"
              + "".join(f" {best[name][m] * 1e3:10.2f} {best[name][m] / one:6.2f}" for m in passes))

if __name__ == "__main__":
    main()
