"""Shared by the fuzz tests: how many cases a lane runs and hypothesis settings for them.

`make test` runs the quick lane (a few hundred cases of each kind); `make fuzz` sets
LAYERPLAN_FUZZ=1 and runs the full counts (well over 10,000 cases in all); `make test-fast` sets
LAYERPLAN_FUZZ=smoke and runs a quarter of the quick counts. Runs are seeded (derandomize): the
same inputs every time, so a failure reproduces."""

import os

from hypothesis import HealthCheck, settings

FULL = os.environ.get("LAYERPLAN_FUZZ") == "1"
SMOKE = os.environ.get("LAYERPLAN_FUZZ") == "smoke"


def examples(quick: int, full: int) -> int:
    return full if FULL else max(1, quick // 4) if SMOKE else quick


def fuzz_settings(quick: int, full: int):
    return settings(max_examples=examples(quick, full), derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
