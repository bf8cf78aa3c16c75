"""`layerplan ppl` against llama.cpp's `llama-perplexity` on the same GGUF, text and context, in one
run: each whole command from spawn to exit (load included, as a user waits for it), and the
perplexity each reports under llama.cpp's protocol (`--protocol llama.cpp`: chunks of the context,
each chunk's second half scored) — issue 47's targets: at least llama-perplexity's speed, and a
perplexity within 1% of its.

    python benchmarks/ppl_vs_llamacpp.py FILE [--text T] [--context 512] [--rounds 3] [--dtype auto]

The text defaults to the built-in corpus (layerplan/corpus.py) cut to CHUNKS whole chunks of the
model's tokens, written to a file both commands read. Figures: medians over rounds, with the range.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNKS = 4


def timed(command: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return seconds, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--text", default=None)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--within", type=float, default=None,
                        help="exit 1 where the two perplexities are further apart than this fraction (0.01: 1%%)")
    args = parser.parse_args()
    from layerplan.app.llamacpp import find_tools, peer_name
    from layerplan.corpus import default_corpus
    from layerplan.machine import read_cpuinfo

    tools = find_tools(("llama-perplexity",))
    if tools is None:
        raise SystemExit("llama.cpp's tools are not built: layerplan peers build")
    with tempfile.TemporaryDirectory() as folder:
        text = Path(args.text) if args.text else Path(folder) / "corpus.txt"
        if not args.text:
            text.write_text(default_corpus())
        layerplan = shutil.which("layerplan") or os.path.join(os.path.dirname(sys.executable), "layerplan")
        ours = [layerplan, "ppl", "--model", args.model, "--text", str(text), "--window", str(args.context),
                "--protocol", "llama.cpp", "--max-tokens", str(CHUNKS * args.context), "--no-compare",
                "--dtype", args.dtype, "--threads", str(args.threads)]
        theirs = [str(tools / "llama-perplexity"), "-m", args.model, "-f", str(text), "-c", str(args.context),
                  "--chunks", str(CHUNKS), "-t", str(args.threads)]
        runs: dict[str, list[float]] = {"layerplan": [], "llama.cpp": []}
        values: dict[str, float] = {}
        for _ in range(args.rounds):
            seconds, output = timed(theirs)
            runs["llama.cpp"].append(seconds)
            values["llama.cpp"] = float(re.search(r"Final estimate: PPL = ([0-9.]+)", output).group(1))
            seconds, output = timed(ours)
            runs["layerplan"].append(seconds)
            values["layerplan"] = json.loads(output[output.index("{"):output.rindex("}") + 1])["perplexity"]
    median = {name: statistics.median(s) for name, s in runs.items()}
    difference = values["layerplan"] / values["llama.cpp"] - 1
    print(json.dumps({
        "model": args.model, "cpu": read_cpuinfo()[0], "dtype": args.dtype, "context": args.context,
        "chunks": CHUNKS, "threads": args.threads, "llama_cpp": peer_name(tools),
        "seconds": {name: round(m, 2) for name, m in median.items()},
        "seconds_range": {name: [round(min(s), 2), round(max(s), 2)] for name, s in runs.items()},
        "speed_vs_llama_cpp": round(median["llama.cpp"] / median["layerplan"], 2),
        "perplexity": values,
        "perplexity_difference": round(difference, 4),
    }, indent=2))
    if args.within is not None and abs(difference) > args.within:
        raise SystemExit(f"the perplexities are {difference:+.2%} apart, more than {args.within:.2%}")


if __name__ == "__main__":
    main()
