"""A GGUF's later load on the torch front end (the path of scan, ppl, search, chat and serve):
`load_model(FILE)` with default settings and one 8-token pass, in a fresh process, spawn to exit,
its panels kept by an earlier load. With --against SRC, another checkout's src/ is timed the same
way in the same run, the two alternated, so that a change's effect is read beside the host's
drift.

    python benchmarks/torch_load.py FILE --rounds 5 [--against /path/to/other/src]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import time, torch
from layerplan.engine.load import load_model
from layerplan.engine.runner import forward
start = time.perf_counter()
model = load_model({path!r})
loaded = time.perf_counter()
forward(model, torch.arange(8)[None] + 100)
import resource
print(loaded - start, getattr(model.native, "file", None) is not None,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def one_run(path: str, src: str | None) -> dict:
    env = dict(os.environ, LAYERPLAN_PANEL_BUILDS="2")  # (both checkouts keep their panels as they alternate)
    if src is not None:  # (ahead of the editable install's path)
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD.format(path=path)], env=env, capture_output=True, text=True,
                         check=True)
    wall = time.perf_counter() - start
    load, described, peak_kb = out.stdout.split()
    return {"wall_s": wall, "load_s": float(load), "file_described": described == "True",
            "peak_mb": int(peak_kb) / 1024}


def summary(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", help="another checkout's src/ folder, timed alternately")
    args = parser.parse_args()
    path = str(Path(args.file).expanduser())
    one_run(path, None)  # (its panels kept, the page cache warm: every timed run a later load)
    if args.against:
        one_run(path, args.against)
    here, there = [], []
    for _ in range(args.rounds):
        here.append(one_run(path, None))
        if args.against:
            there.append(one_run(path, args.against))
    result = {"file": path, "rounds": args.rounds, "this": {"wall_s": summary(here, "wall_s"),
                                                             "load_s": summary(here, "load_s"),
                                                             "peak_mb": summary(here, "peak_mb"),
                                                             "file_described": here[0]["file_described"]}}
    if there:
        result["against"] = {"src": args.against, "wall_s": summary(there, "wall_s"),
                             "load_s": summary(there, "load_s"), "peak_mb": summary(there, "peak_mb"),
                             "file_described": there[0]["file_described"]}
        result["ratio_wall"] = round(statistics.median(r["wall_s"] for r in here)
                                     / statistics.median(r["wall_s"] for r in there), 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
