"""Time of the full block-repeat scan of the default model against the naive baseline, in one run.

    python benchmarks/block_scan.py [--tokens 256] [--measure ppl --measure arithmetic] [--probe-items 24]
                                    [--dtype float32] [--repeats 1|2|1,2] [--naive-sample 12] [--limit N] [--workers W]

The scan: every block i..j of the 30 layers (465 blocks) repeated once, scored on perplexity of
--tokens calibration tokens and one built-in probe set, the model's residual stream before each
layer kept from one pass and only each candidate's tail run. The naive baseline runs every
candidate from the embeddings; it is timed on --naive-sample blocks spread evenly over the scan
order and extrapolated to all blocks (said so in the output), and its scores are checked equal
to the scan's. --limit N scans only the first N blocks (a quick check that the script runs).
--workers W scores W candidates at once, one thread each (both the scan and the naive sample);
the default 1 gives each candidate torch's threads.
"""

from __future__ import annotations

import argparse
import time

import torch

from layerplan.machine import cpu_info
from layerplan.engine.load import load_model
from layerplan.search.blocks import block_candidates, block_scan, parse_repeats
from layerplan.search.measure_registry import MeasureInputs
from layerplan.search.measures import build_scorers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--measure", action="append", default=None, help="default: ppl and arithmetic")
    parser.add_argument("--probe-items", type=int, default=24)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", default="1", help="1, 2 or 1,2")
    parser.add_argument("--naive-sample", type=int, default=12)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    measures = args.measure or ["ppl", "arithmetic"]
    inputs = MeasureInputs(tokens=args.tokens, probe_items=args.probe_items)
    counts = parse_repeats(args.repeats)

    model = load_model("smollm2", dtype=args.dtype)
    blocks = block_candidates(model.num_layers)[: args.limit]
    print(cpu_info().line())
    print(f"{model.name}, {args.dtype}, engine {'native' if model.native is not None else 'eager'}, "
          f"{torch.get_num_threads()} threads, {args.workers} worker(s); {len(blocks)} blocks repeated {args.repeats}x; measures "
          f"{', '.join(measures)} ({args.tokens} calibration tokens, {args.probe_items} probe items)")

    start = time.perf_counter()
    scorers = build_scorers(model, measures, inputs)
    prepared = time.perf_counter() - start
    result = block_scan(model, scorers, blocks, counts, workers=args.workers)
    total = prepared + result.seconds
    print(f"shared prefix: {total:.1f}s = {prepared:.1f}s base pass (every measure's stream kept before each layer) "
          f"+ {result.seconds:.1f}s for {len(result.rows)} candidates ({result.seconds / len(result.rows):.2f}s each)")

    count = min(args.naive_sample, len(blocks))
    picks = sorted({round(k * (len(blocks) - 1) / max(count - 1, 1)) for k in range(count)})
    start = time.perf_counter()
    naive_scorers = build_scorers(model, measures, inputs, reuse=False)
    naive_prepared = time.perf_counter() - start
    naive = block_scan(model, naive_scorers, [blocks[k] for k in picks], counts, workers=args.workers)
    per_candidate = naive.seconds / len(naive.rows)
    estimate = naive_prepared + per_candidate * len(result.rows)
    scanned = {(row.start, row.end, row.repeats): row for row in result.rows}
    same = all(abs(row.score(m).value - scanned[row.start, row.end, row.repeats].score(m).value)
               <= 1e-6 * max(1.0, abs(row.score(m).value)) for row in naive.rows for m in measures)
    print(f"naive (from the embeddings): {len(naive.rows)} sampled candidates took {naive.seconds:.1f}s "
          f"({per_candidate:.2f}s each); all {len(result.rows)} extrapolated: {estimate:.0f}s "
          f"-> shared prefix is {estimate / total:.2f}x faster; sampled scores equal the scan's: {'yes' if same else 'NO'}")
    best = result.best()
    print(f"best block by {measures[0]}: {best.start}-{best.end} ({best.plan}), change "
          f"{best.score(measures[0]).change:+.4g} [{best.score(measures[0]).change_low:+.4g}, "
          f"{best.score(measures[0]).change_high:+.4g}]")


if __name__ == "__main__":
    main()
