"""How fast a process could start on a GGUF without torch and transformers: the floor under
issue 28's cold-start and memory targets, against llama.cpp's own cold start on the same file.

    python benchmarks/cold_start_floor.py [MODEL] [--rounds 3]

A child process of plain Python does what a front end of numpy and the native kernels alone
would have to do before its first pass: import numpy and ctypes, load the kernels' library,
read the file's tokenizer (the `tokenizers` package, from the tokenizer.json layerplan's index of
the GGUF keeps) and encode a prompt, and map the packed panels layerplan keeps for the file,
touching every page. What it leaves out, the first pass itself and building the pass's tables,
is milliseconds here (a SmolLM2 step is ~3 ms). Run `layerplan generate` (or the stored
benchmark) on the file once first, so the index and the panels exist. Beside it: layerplan's
cold start today (a new process: interpreter, torch, transformers, load, one token) and
`llama-bench -n 1 -p 0` timed from its start, as benchmarks/stored_vs_llamacpp.py times both.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FLOOR = r"""
import ctypes, mmap, os, sys, time
start = float(sys.argv[1])
import numpy as np
from tokenizers import Tokenizer
ctypes.CDLL(sys.argv[2])
Tokenizer.from_file(sys.argv[3]).encode("Write a short poem about the sea.")
held, touched = [], 0  # every panel mapped and kept, as a run holds them
for root, _, names in os.walk(sys.argv[4]):
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            if os.fstat(f.fileno()).st_size:
                held.append(np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8))
                touched += int(held[-1][::4096].sum())
print(time.time() - start, PEAK())
"""

LAYERPLAN = r"""
import sys, time
start = float(sys.argv[1])
import torch
from layerplan.engine.load import load_model
from layerplan.engine.runner import forward, new_cache
loaded = load_model(sys.argv[2], dtype="stored-fast")
forward(loaded, torch.tensor([[100]]), cache=new_cache(loaded.plan(), 16), last_only=True)
print(time.time() - start, PEAK())
"""

# a process's peak RSS in MB, as /proc says it (VmHWM: this image's own; getrusage's ru_maxrss
# would keep the parent's peak, which Linux carries over fork and exec)
PEAK = 'PEAK = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024\n'


def _timed(code: str, *args: str) -> tuple[float, float]:
    """(seconds from this call to the child's end of work, the child's peak RSS in MB)."""
    done = subprocess.run([sys.executable, "-c", PEAK + code, repr(time.time()), *args], capture_output=True,
                          text=True, check=True)
    seconds, peak = (float(v) for v in done.stdout.split()[-2:])
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    # (torch loads in this process only: each child times its own start)
    from layerplan.app.llamacpp import find_tools
    from layerplan.engine.kernel_library import kernels_key, library
    from layerplan.engine.load import load_model
    from layerplan.engine.panel_cache import PanelCache
    from layerplan.machine import read_cpuinfo
    from layerplan.models.loading import _stored_index, gguf_of
    from stored_vs_llamacpp import llama_cold_start

    tools = find_tools()
    if tools is None:
        raise SystemExit("llama.cpp's tools are not built: layerplan peers build")
    loaded = load_model(args.model, dtype="stored-fast")  # makes the index and the panels where missing
    gguf = gguf_of(loaded.source)
    panels = PanelCache.for_file(gguf, kernels_key())
    if panels is None or not any(panels.folder.glob("*.panels")):
        raise SystemExit(f"no packed panels are kept for {gguf.name} (LAYERPLAN_PANEL_CACHE off?)")
    tokenizer = _stored_index(gguf) / "tokenizer.json"
    runs: dict[str, list[tuple[float, float]]] = {"floor": [], "layerplan": [], "llama.cpp": []}
    for _ in range(args.rounds):  # in turn, so a change in the machine's load falls on all three
        runs["floor"].append(_timed(FLOOR, library()._name, str(tokenizer), str(panels.folder)))
        runs["layerplan"].append(_timed(LAYERPLAN, str(gguf)))
        runs["llama.cpp"].append(llama_cold_start(tools, gguf, args.threads))
    best = {name: (min(s for s, _ in rows), min(p for _, p in rows)) for name, rows in runs.items()}
    print(json.dumps({
        "model": str(gguf), "cpu": read_cpuinfo()[0], "rounds": args.rounds,
        "seconds": {name: b[0] for name, b in best.items()}, "peak_rss_mb": {name: b[1] for name, b in best.items()},
        "floor_vs_llama_cpp": best["floor"][0] / best["llama.cpp"][0],
        "layerplan_vs_llama_cpp": best["layerplan"][0] / best["llama.cpp"][0],
    }, indent=2))


if __name__ == "__main__":
    main()
