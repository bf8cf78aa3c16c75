"""A drafted `layerplan generate` on both front ends: the light one (decoding/rounds.py on the
kernels alone) against the torch one (LAYERPLAN_FRONT_END=torch: speculative.py), and plain
decoding on the light one, each as a new process on the same built-in prompt.

    python benchmarks/drafted_front_ends.py [MODEL] [--draft suffix] [--prompt code] [--rounds 3] [-n 128]

Each round runs the three in turn (a change in the machine's load falls on all); each reports
its decode rate from --json (tokens_per_second: the new tokens over the seconds after the prefill) and its
whole time from spawn to exit. Prints one JSON object: medians with their ranges, and every
drafted run's text checked equal to plain's (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def run(command: list[str], env: dict) -> tuple[float, float, str]:
    """(decode tokens/s, seconds from spawn to exit, the text) of one generate."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    seconds = time.perf_counter() - start
    stats = json.loads(done.stderr[done.stderr.index("{"):])
    return stats["tokens_per_second"], seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--draft", default="suffix")
    parser.add_argument("--prompt", default="code")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-n", "--new-tokens", type=int, default=128)
    args = parser.parse_args()
    import compileall

    import layerplan
    from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS
    from layerplan.machine import read_cpuinfo

    compileall.compile_dir(os.path.dirname(layerplan.__file__), quiet=1)  # (as an installed wheel has them)
    layerplan_path = shutil.which("layerplan") or os.path.join(os.path.dirname(sys.executable), "layerplan")
    command = [layerplan_path, "generate", PROMPTS[args.prompt], "-m", args.model, "-n", str(args.new_tokens),
               "--json", "--no-stream", *(["--chat"] if args.prompt in CHAT_PROMPTS else [])]
    light = {k: v for k, v in os.environ.items() if k != "LAYERPLAN_FRONT_END"}
    kinds = {"plain (light)": (command, light), "drafted (light)": (command + ["--draft", args.draft], light),
             "drafted (torch front end)": (command + ["--draft", args.draft],
                                           {**light, "LAYERPLAN_FRONT_END": "torch"})}
    for line, env in kinds.values():  # (warm-up: the file's index and panels, the page cache)
        run(line, env)
    runs: dict[str, list[tuple[float, float, str]]] = {name: [] for name in kinds}
    for _ in range(args.rounds):
        for name, (line, env) in kinds.items():
            runs[name].append(run(line, env))
    texts = {text for rows in runs.values() for _, _, text in rows}
    print(json.dumps({
        "model": args.model, "draft": args.draft, "prompt": args.prompt, "new_tokens": args.new_tokens,
        "cpu": read_cpuinfo()[0], "rounds": args.rounds,
        "decode_tokens_per_second": {name: round(statistics.median(r for r, _, _ in rows), 1)
                                     for name, rows in runs.items()},
        "decode_range": {name: [round(min(r for r, _, _ in rows), 1), round(max(r for r, _, _ in rows), 1)]
                         for name, rows in runs.items()},
        "whole_seconds": {name: round(statistics.median(s for _, s, _ in rows), 2) for name, rows in runs.items()},
        "same_text": len(texts) == 1,
    }, indent=2))


if __name__ == "__main__":
    main()
