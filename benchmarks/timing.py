"""The timing helper the benchmark scripts share (they run as `python benchmarks/NAME.py`, so
this folder is on the import path)."""

from __future__ import annotations

import statistics
import time


def median_ms(run, repeats: int, warmup: int = 1) -> float:
    """Median wall time of run() in milliseconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3
