"""`layerplan scan` on a GGUF on the light front end (what the command starts on) against the same
command line on the torch front end (LAYERPLAN_FRONT_END=torch), in one run, alternated round by
round: each whole command from spawn to exit, its peak RSS (ru_maxrss of a child of a probe process
of its own), and whether both wrote the same scan.json but for the seconds.

    python benchmarks/scan_front_ends.py FILE [--tokens 512] [--kinds attention,mlp,layer] [--rounds 2]

The file's index and panels are made by a warm-up run first (a later use, as a user's second scan
finds them). Figures: medians over rounds, with the range. Prints one JSON object; exits 1 where the
two scan.json files differ but for the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# runs argv[2:] with LAYERPLAN_FRONT_END=argv[1] and prints its seconds and the child's peak RSS (KB)
_PROBE = ("import os, resource, subprocess, sys, time\n"
          "env = {**os.environ, 'LAYERPLAN_FRONT_END': sys.argv[1]}\n"
          "start = time.perf_counter()\n"
          "done = subprocess.run(sys.argv[2:], env=env, capture_output=True, text=True)\n"
          "seconds = time.perf_counter() - start\n"
          "if done.returncode: sys.exit(done.stderr.strip().splitlines()[-1])\n"
          "print(seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--kinds", default="attention,mlp,layer")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from layerplan.machine import read_cpuinfo

    layerplan = shutil.which("layerplan") or os.path.join(os.path.dirname(sys.executable), "layerplan")
    fronts = {"light": "", "torch": "torch"}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in fronts}
    with tempfile.TemporaryDirectory() as folder:
        def line(name: str) -> list[str]:
            return [layerplan, "scan", "--model", args.model, "--tokens", str(args.tokens), "--kinds", args.kinds,
                    "--out", str(Path(folder) / name)]

        warm = subprocess.run([layerplan, "generate", "--model", args.model, "Hi", "-n", "1"], capture_output=True,
                              text=True)
        if warm.returncode:
            raise SystemExit(f"the warm-up run failed: {warm.stderr.strip().splitlines()[-1:]}")
        for _ in range(args.rounds):
            for name, front_end in fronts.items():
                probe = subprocess.run([sys.executable, "-c", _PROBE, front_end, *line(name)], capture_output=True,
                                       text=True)
                if probe.returncode:
                    raise SystemExit(f"the {name} front end's scan failed: {probe.stderr.strip()}")
                seconds, peak_kb = probe.stdout.split()
                runs[name].append((float(seconds), int(peak_kb) / 1024))
        written = [json.loads((Path(folder) / name / "scan.json").read_text()) for name in fronts]
    for result in written:
        result.pop("seconds")
    median = {name: statistics.median(s for s, _ in r) for name, r in runs.items()}
    peak = {name: statistics.median(m for _, m in r) for name, r in runs.items()}
    print(json.dumps({
        "model": args.model, "cpu": read_cpuinfo()[0], "tokens": args.tokens, "kinds": args.kinds,
        "candidates": len(written[0]["items"]),
        "seconds": {name: round(m, 1) for name, m in median.items()},
        "seconds_range": {name: [round(min(s for s, _ in r), 1), round(max(s for s, _ in r), 1)]
                          for name, r in runs.items()},
        "peak_rss_mb": {name: round(m) for name, m in peak.items()},
        "peak_rss_range_mb": {name: [round(min(m for _, m in r)), round(max(m for _, m in r))]
                              for name, r in runs.items()},
        "time_light_over_torch": round(median["light"] / median["torch"], 3),
        "same_scan": written[0] == written[1],
    }, indent=2))
    if written[0] != written[1]:
        raise SystemExit("the two front ends wrote different scans")


if __name__ == "__main__":
    main()
