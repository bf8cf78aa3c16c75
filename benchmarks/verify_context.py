"""A verify pass's cost against the context it attends over: a pass of k new tokens after `at`
cached positions (the cache cut back to `at` before each), median of the timed rounds after one
warm one, on the light front end in the default arithmetic (stored-fast: the KV cache in f16),
with the C heap kept as the `layerplan` command keeps it (heap.py), 2 threads. The probe times its
passes after 100 positions; this shows what they cost further on.

    python benchmarks/verify_context.py MODEL [--at 100,500,1000,2000] [--k 1,2,4,8] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from layerplan.heap import keep_freed_memory
from layerplan.lite.model import LiteModel
from layerplan.lite.request import ARITHMETICS
from layerplan.models.gguf_place import gguf_of

PREFILL_CHUNK = 256  # the context is written in passes of this many tokens


def pass_ms(model: LiteModel, at: int, lengths: list[int], rounds: int) -> dict[int, float]:
    """Median ms of a pass over k new tokens after `at` cached positions, per k (interleaved)."""
    plan = model.plan()
    ids = np.random.default_rng(0).integers(0, min(model.vocab_size, model.embedding.rows), at + max(lengths))
    cache = model.new_cache(plan, at + max(lengths))
    for start in range(0, at, PREFILL_CHUNK):
        model.logits(ids[start:min(at, start + PREFILL_CHUNK)], cache, start)
    samples: dict[int, list[float]] = {k: [] for k in lengths}
    for round_ in range(rounds + 1):  # the first warms up
        for k in lengths:
            cache.crop(at)
            began = time.perf_counter()
            model.logits(ids[at:at + k], cache, at, last_only=k == 1)
            if round_:
                samples[k].append(time.perf_counter() - began)
    return {k: 1000 * statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--at", default="100,500,1000,2000", help="cached positions before the pass")
    parser.add_argument("--k", default="1,2,4,8", help="new tokens a pass")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    keep_freed_memory()
    model = LiteModel(gguf_of(args.model), ARITHMETICS["auto"], threads=2, with_tokenizer=False)
    lengths = [int(k) for k in args.k.split(",")]
    for at in (int(a) for a in args.at.split(",")):
        times = pass_ms(model, at, lengths, args.rounds)
        print(f"at {at:5d}: " + "  ".join(f"k={k} {ms:6.2f} ms" for k, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
