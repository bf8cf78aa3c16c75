"""Two builds of the kernels timed in turns in one process on a GGUF's whole passes (a decoding step
and verify passes of 4 and 8 tokens) after DEPTH cached positions: this checkout's build against
another checkout's (--against SRC) or one made with other flags (--against-flags). The light
front end's model runs both (lite/model.py; its library swapped between the timings), so the
packed weights, the cache and the host's drift are the same for both; kernel_builds_ab.py times
products alone. Both builds' logits are checked equal unless --arithmetic-changed.

    python benchmarks/passes_ab.py MODEL --against /path/to/other/checkout/src [--depth 2000] [--rounds 15]

Prints one JSON object: per pass, both builds' median ms and the median of the paired ratios
(this / other) with its quartiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import layerplan.lite.model as lite_model
from kernel_builds_ab import library_built
from layerplan.engine import kernel_library as kl
from layerplan.lite.model import LiteModel
from layerplan.lite.request import ARITHMETICS
from layerplan.machine import kernels_cpu_info
from layerplan.models.gguf_place import gguf_of

PASSES = {"step": 1, "pass4": 4, "pass8": 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--against", help="another checkout's src folder")
    parser.add_argument("--against-flags", help="LAYERPLAN_KERNEL_FLAGS of the other build")
    parser.add_argument("--depth", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtype", default="auto", choices=sorted(ARITHMETICS))
    parser.add_argument("--arithmetic-changed", action="store_true")
    args = parser.parse_args()
    if args.against is None and args.against_flags is None:
        raise SystemExit("give --against SRC or --against-flags FLAGS: the build to compare with")
    libs = {"this": kl._load(library_built(None, None)),
            "other": kl._load(library_built(args.against, args.against_flags))}
    model = LiteModel(gguf_of(args.model), ARITHMETICS[args.dtype], threads=2)
    plan = model.plan()
    ids = np.random.default_rng(0).integers(100, min(model.vocab_size, 10000), args.depth + 8).tolist()
    cache = model.new_cache(plan, args.depth + 8)
    model.logits(ids[:args.depth], cache, 0)
    seconds = {build: {name: [] for name in PASSES} for build in libs}
    outputs = {}
    for round_ in range(args.rounds):
        for build, lib in libs.items():
            lite_model.library = lambda lib=lib: lib
            for name, count in PASSES.items():
                times = []
                for _ in range(5):
                    cache.crop(args.depth)
                    start = time.perf_counter()
                    logits = model.logits(ids[args.depth:args.depth + count], cache, args.depth, last_only=False)
                    times.append(time.perf_counter() - start)
                seconds[build][name].append(statistics.median(times))
                if round_ == 0:
                    outputs[build, name] = logits.copy()
    if not args.arithmetic_changed:
        for name in PASSES:
            if not np.array_equal(outputs["this", name], outputs["other", name]):
                raise SystemExit(f"the builds' logits differ ({name}): give --arithmetic-changed if they should")
    result = {"cpu": kernels_cpu_info(2, kl.choose_isa().name).line(),
              "model": args.model, "depth": args.depth, "rounds": args.rounds,
              "other": args.against or f"LAYERPLAN_KERNEL_FLAGS={args.against_flags}", "passes": {}}
    for name in PASSES:
        this, other = seconds["this"][name], seconds["other"][name]
        ratios = [a / b for a, b in zip(this, other)]
        quartiles = statistics.quantiles(ratios, n=4)
        result["passes"][name] = {"this_ms": round(1e3 * statistics.median(this), 3),
                                  "other_ms": round(1e3 * statistics.median(other), 3),
                                  "ratio": round(statistics.median(ratios), 3),
                                  "ratio_quartiles": [round(quartiles[0], 3), round(quartiles[2], 3)]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
