"""Two builds of the kernels timed in turns in one process: this checkout's against another's (or a
build made with other LAYERPLAN_KERNEL_FLAGS), on one-row (or --rows) products of random blocks in
the shapes and formats of the real Qwen2.5-Coder-1.5B Q4_K_M (or, --shapes smollm2, the packaged
SmolLM2-135M Q4_1): each shape alone, and a whole decoding step's products in a row. A product reads from memory, whose speed drifts on a shared
host by 10-20% within a minute; builds alternated product by product see the same drift, so the
median of the paired ratios resolves a few percent where runs in turn do not. Both builds' outputs
are checked equal, unless --arithmetic-changed says the builds compute differently.

    python benchmarks/kernel_builds_ab.py --against /path/to/other/checkout/src [--rows 1] [--rounds 30]
                                          [--shapes qwen1.5b|smollm2]
    python benchmarks/kernel_builds_ab.py --against-flags=-DLP_AHEAD_PANELS=1

Prints one JSON object: per case, both builds' median ms and GB/s and the ratio (this / other).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from layerplan.engine import kernel_library as kl
from layerplan.machine import cpu_info
from quant_products import stored

BUILD = "from layerplan.engine import kernel_library as kl; print(kl.build(kl.choose_isa(), kl._compiler()))"

# (name, format, rows n, inputs k, how many in a row): a model's matrices, a step's worth of each
SHAPES = {
    "qwen1.5b": [("qkv", "Q4_K", 1792, 1536, 28), ("o", "Q4_K", 1536, 1536, 28), ("gate_up", "Q4_K", 17920, 1536, 28),
                 ("down Q4_K", "Q4_K", 1536, 8960, 14), ("down Q6_K", "Q6_K", 1536, 8960, 14),
                 ("lm head", "Q6_K", 151936, 1536, 1)],
    # the packaged SmolLM2-135M Q4_1: 30 layers, 9 heads and 3 kv heads of 64, the head tied, Q8_0
    "smollm2": [("qkv", "Q4_1", 960, 576, 30), ("o", "Q4_1", 576, 576, 30), ("gate_up", "Q4_1", 3072, 576, 30),
                ("down", "Q4_1", 576, 1536, 30), ("lm head", "Q8_0", 49152, 576, 1)],
}


def library_built(src: str | None, flags: str | None) -> Path:
    """The path of the kernels built from `src` (another checkout's src; None: this one) with
    `flags` (LAYERPLAN_KERNEL_FLAGS; None: as set here)."""
    env = dict(os.environ, LAYERPLAN_PANEL_BUILDS="2")  # (both builds keep their panels as they alternate)
    if src is not None:
        env["PYTHONPATH"] = src
    if flags is not None:
        env["LAYERPLAN_KERNEL_FLAGS"] = flags
    out = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", help="another checkout's src folder, whose kernels are the other build")
    parser.add_argument("--against-flags", help="LAYERPLAN_KERNEL_FLAGS of the other build")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen1.5b", help="whose matrices")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arithmetic-changed", action="store_true",
                        help="the builds compute different numbers (a change of arithmetic): do not compare outputs")
    args = parser.parse_args()
    if args.against is None and args.against_flags is None:
        raise SystemExit("give --against SRC or --against-flags FLAGS: the build to compare with")
    abi = kl.ABI
    paths = {"this": library_built(None, None), "other": library_built(args.against, args.against_flags)}
    libs = {name: kl._load(path) for name, path in paths.items()}
    rng = np.random.default_rng(0)
    matrix = abi.structs["lp_matrix"]
    kept = []
    cases = {}  # name -> {build: [(lp_matrix, k, n), ...]}, bytes
    shapes = SHAPES[args.shapes]
    for name, fmt_name, n, k, count in shapes:
        fmt = abi.constants[f"LP_FORMAT_{fmt_name}"]
        rows = stored(fmt_name, n, k, rng)
        per_build = {}
        for build, lib in libs.items():
            size = lib.lp_packed_bytes(fmt, n, k)
            mats = []
            for _ in range(count):  # each its own copy: read from memory, as a step's layers are
                buf = kl.huge_page_buffer(size)
                kl.check(lib.lp_pack(ctypes.c_void_p(rows.ctypes.data), fmt, n, k, ctypes.c_void_p(buf.ctypes.data)),
                         "pack")
                kept.append(buf)
                mats.append((matrix(ctypes.c_void_p(buf.ctypes.data), None, n, k, fmt, abi.LP_ARITH_INT8), k, n))
            per_build[build] = mats
        cases[name] = (per_build, size * count)
    xs = {k: rng.standard_normal((args.rows, k), dtype=np.float32) for k in {k for _, _, _, k, _ in shapes}}
    widest = max(n for _, _, n, _, _ in shapes)
    outputs = {build: np.zeros(args.rows * widest, np.float32) for build in libs}

    def run(build: str, mats) -> float:
        lib, y = libs[build], outputs[build]
        start = time.perf_counter()
        for mat, k, _ in mats:
            kl.check(lib.lp_linear(ctypes.c_void_p(xs[k].ctypes.data), abi.LP_DTYPE_F32, ctypes.byref(mat),
                                   ctypes.c_void_p(y.ctypes.data), abi.LP_DTYPE_F32, args.rows, args.threads),
                     "product")
        return time.perf_counter() - start

    step = {build: [m for per_build, _ in cases.values() for m in per_build[build]] for build in libs}
    cases["whole step"] = (step, sum(size for _, size in cases.values()))
    result = {"cpu": cpu_info().line(), "isa": libs["this"].isa, "shapes": args.shapes, "rows": args.rows,
              "rounds": args.rounds,
              "other": args.against or f"LAYERPLAN_KERNEL_FLAGS={args.against_flags}", "cases": {}}
    for name, (per_build, size) in cases.items():
        times = {build: [] for build in libs}
        for r in range(args.rounds):
            for build in (("this", "other") if r % 2 == 0 else ("other", "this")):
                times[build].append(run(build, per_build[build]))
            if r == 0 and not args.arithmetic_changed and not np.array_equal(outputs["this"], outputs["other"]):
                raise SystemExit(f"{name}: the two builds' products differ")
        ratios = sorted(a / b for a, b in zip(times["this"], times["other"]))
        result["cases"][name] = {
            "mb": round(size / 1e6, 1),
            **{f"{build}_ms": round(statistics.median(t) * 1e3, 3) for build, t in times.items()},
            **{f"{build}_gb_s": round(size / statistics.median(t) / 1e9, 1) for build, t in times.items()},
            "ratio": round(statistics.median(ratios), 3),
            "ratio_quartiles": [round(float(np.percentile(ratios, q)), 3) for q in (25, 75)]}
        print(f"{name:10} {size / 1e6:7.1f} MB  this/other {result['cases'][name]['ratio']:.3f}", file=sys.stderr)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
