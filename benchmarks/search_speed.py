"""Speed of the search machinery on the default model against the naive baseline, in one run.

    python benchmarks/search_speed.py [--tokens 512] [--dtype bfloat16] [--scan-repeats 3] [--steps 20] [--naive-steps 2]

Prints: the sub-layer scan (60 candidates) with stream reuse, --scan-repeats times (this shared
2-core machine varies by a second or two from run to run), and naively once; a greedy search of
--steps steps with reuse + pruning + memo; and the naive greedy (no reuse, no pruning, no memo)
for --naive-steps steps, whose per-step time is extrapolated to --steps (said so in the output).
"""

from __future__ import annotations

import argparse
import time

import torch

from layerplan.engine.load import load_model
from layerplan.search.evaluate import calibration_ids
from layerplan.search.evaluator import PlanEvaluator
from layerplan.search.greedy import greedy_search
from layerplan.search.scan import scan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--scan-repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--naive-steps", type=int, default=2)
    args = parser.parse_args()
    model = load_model("smollm2", dtype=args.dtype)
    ids = calibration_ids(model, tokens=args.tokens)
    print(f"{model.name}, {args.dtype}, {torch.get_num_threads()} threads, {args.tokens} calibration tokens")

    fast = [scan(model, ids, kinds=["attention", "mlp"]) for _ in range(args.scan_repeats)]
    naive = scan(model, ids, kinds=["attention", "mlp"], reuse=False)
    times = sorted(result.seconds for result in fast)
    median = times[len(times) // 2]
    print(f"sub-layer scan, {len(fast[0].items)} candidates: reuse {', '.join(f'{t:.1f}s' for t in times)} "
          f"(median {median:.1f}s), naive {naive.seconds:.1f}s -> {naive.seconds / median:.2f}x")

    start = time.perf_counter()
    evaluator = PlanEvaluator(model, ids)
    result = greedy_search(evaluator, "kl", budget=args.steps)
    ours = time.perf_counter() - start
    print(f"greedy {args.steps} steps (reuse, prune 30%, memo, early abort): {ours:.1f}s, {evaluator.evaluations} "
          f"evaluations ({evaluator.aborted} stopped early); plan {result.best_plan}")

    start = time.perf_counter()
    naive_evaluator = PlanEvaluator(model, ids, reuse=False)
    greedy_search(naive_evaluator, "kl", budget=args.naive_steps, prune=0.0)
    naive_s = time.perf_counter() - start
    # a naive greedy pass re-scores every remaining candidate: pass k has (items - k) of them
    items = 2 * (model.num_layers - 2)
    per_candidate = naive_s / naive_evaluator.evaluations
    estimate = per_candidate * sum(items - k for k in range(args.steps))
    print(f"naive greedy: {args.naive_steps} steps took {naive_s:.1f}s ({per_candidate:.2f}s per candidate); "
          f"{args.steps} steps extrapolated: {estimate:.0f}s -> {estimate / ours:.1f}x")


if __name__ == "__main__":
    main()
