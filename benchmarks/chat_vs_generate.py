"""`layerplan chat` against `layerplan generate` on the same request, in one run: a greedy reply to
one message, through a chat session fed by a pipe (its `/stats` line) and through `generate --chat
--json` (its tokens_per_second), alternated; each in a process of its own, as a user runs them.
Prints one JSON object with each side's rates, their medians and the ratio chat / generate.

    python benchmarks/chat_vs_generate.py [--model smollm2] [--dtype stored] [--rounds 6] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path
import sys

from layerplan.machine import read_cpuinfo

MESSAGE = "Explain what a compiler does."


def _layerplan() -> str:
    return str(Path(sys.executable).with_name("layerplan"))


def _chat_rate(args) -> float:
    done = subprocess.run([_layerplan(), "chat", "--model", args.model, "--dtype", args.dtype, "-n", str(args.tokens)],
                          input=f"{MESSAGE}\n/stats\n", capture_output=True, text=True, check=True, timeout=600)
    line = next(line for line in done.stderr.splitlines() + done.stdout.splitlines() if line.startswith("last reply"))
    return float(re.search(r"([\d.]+) tokens/s", line).group(1))


def _generate_rate(args) -> float:
    done = subprocess.run([_layerplan(), "generate", "--chat", "--model", args.model, "--dtype", args.dtype,
                           "-n", str(args.tokens), "--json", MESSAGE], capture_output=True, text=True, check=True,
                          timeout=600)
    return float(re.search(r'"tokens_per_second": ([\d.]+)', done.stdout + done.stderr).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="stored")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    chat, generate = [], []
    for _ in range(args.rounds):
        chat.append(_chat_rate(args))
        generate.append(_generate_rate(args))
    print(json.dumps({"model": args.model, "dtype": args.dtype, "tokens": args.tokens, "cpu": read_cpuinfo()[0],
                      "chat_tokens_per_second": chat, "generate_tokens_per_second": generate,
                      "chat_median": statistics.median(chat), "generate_median": statistics.median(generate),
                      "ratio": statistics.median(chat) / statistics.median(generate)}))


if __name__ == "__main__":
    main()
