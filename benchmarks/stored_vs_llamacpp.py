"""A GGUF run as stored against llama.cpp's own llama-bench on the same file, in one run: decoding
tokens/s after a short context, the cost of an 8-token pass in one-token steps, the peak resident
memory, and the time from a cold start (a new process: interpreter, imports, load) to the first
token. A GGUF's packed panels are kept on disk after its first load (engine/panel_cache.py); the
first round packs them when none are kept. Each figure is the median over rounds, with its range.

    python benchmarks/stored_vs_llamacpp.py smollm2                        # default settings (--dtype auto)
    python benchmarks/stored_vs_llamacpp.py /tmp/qwen2-1.5b-random-Q4_K_M.gguf --rounds 3
    python benchmarks/stored_vs_llamacpp.py smollm2 --dtype stored-fast   # integer products, as llama.cpp
    python benchmarks/stored_vs_llamacpp.py smollm2 --depth 1024          # decoding after 1024 tokens
    python benchmarks/stored_vs_llamacpp.py smollm2 --prefill 512         # and a 512-token prompt's pass

Rounds alternate layerplan and llama-bench (each its own process), so drift in the machine's speed
hits both; each figure is the median over rounds (its range beside it). Needs llama.cpp's tools (`layerplan peers build`).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONTEXT = 64  # tokens decoded from (llama-bench: none, unless --depth)
PASS = 8


def measure_layerplan(model: str, new_tokens: int, threads: int, dtype: str, started_at: float,
                      context: int = CONTEXT, prefill: int = 0) -> dict:
    """(in a process of its own, so peak memory and the cold start are this run's alone; the cold
    start counts from `started_at`, the wall time at which the parent started this process, as
    llama.cpp's counts from the start of its process: the interpreter and imports count)"""
    import torch

    from layerplan.engine.load import load_model
    from layerplan.engine.runner import forward, new_cache
    from layerplan.heap import keep_freed_memory

    keep_freed_memory()  # as the `layerplan` command's process does (a long prompt's scratch is kept)
    torch.set_num_threads(threads)
    loaded = load_model(model, dtype=dtype)
    ids = torch.arange(context)[None] + 100
    cache = new_cache(loaded.plan(), context + new_tokens + PASS + 1)
    forward(loaded, ids[:, :1], cache=cache, last_only=True)
    first_token = time.time() - started_at
    for start in range(1, context, 512):  # the rest of the context, in chunks
        forward(loaded, ids[:, start:start + 512], cache=cache, start_pos=start, last_only=True)
    steps = []
    for i in range(new_tokens):
        t = time.perf_counter()
        forward(loaded, torch.tensor([[7 + i]]), cache=cache, start_pos=context + i, last_only=True)
        steps.append(time.perf_counter() - t)
    passes = []
    for _ in range(5):
        t = time.perf_counter()
        forward(loaded, torch.arange(PASS)[None] + 3, cache=cache, start_pos=context + new_tokens)
        passes.append(time.perf_counter() - t)
    step = sorted(steps)[len(steps) // 2]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before a long prompt's buffers
    prompts = []
    for _ in range(2 if prefill else 0):  # a prompt of `prefill` tokens into an empty cache, as llama-bench's pp
        cache = new_cache(loaded.plan(), prefill + 1)
        t = time.perf_counter()
        for start in range(0, prefill, 512):  # in chunks, as a long prompt goes (engine/runner.py)
            forward(loaded, (torch.arange(prefill)[None] + 100)[:, start:start + 512], cache=cache, start_pos=start,
                    last_only=True)
        prompts.append(time.perf_counter() - t)
    return {"decode_tokens_per_second": 1 / step, "pass_steps": min(passes) / step,
            "prefill_tokens_per_second": prefill / min(prompts) if prompts else None,
            "first_token_seconds": first_token,
            "peak_rss_mb": peak_mb,
            "formats": loaded.stored.formats}


def measure_llama_cpp(gguf: Path, new_tokens: int, threads: int, depth: int = 0, prefill: int = 0) -> dict:
    from layerplan.app.llamacpp import find_tools
    from layerplan.app.peers import llama_bench

    tools = find_tools()
    if tools is None:
        raise SystemExit("llama.cpp's tools are not built: layerplan peers build")
    run = llama_bench(tools / "llama-bench", gguf, threads, new_tokens, pass_length=PASS, depth=depth)
    cold, peak_mb = llama_cold_start(tools, gguf, threads)
    # its pp test of the prompt's length (a pass into an empty context); -n 1: its least tg test
    prompt = llama_bench(tools / "llama-bench", gguf, threads, 1, pass_length=prefill) if prefill else None
    return {"decode_tokens_per_second": run.tg_tokens_per_second, "pass_steps": run.pass_steps(PASS),
            "prefill_tokens_per_second": prompt.pp_tokens_per_second.get(prefill) if prompt else None,
            "first_token_seconds": cold, "peak_rss_mb": peak_mb, "build": run.build}


def llama_cold_start(tools: Path, gguf: Path, threads: int) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of llama.cpp's cold start to the first token (`llama-bench -n 1
    -p 0`: load, then one token), in a process whose peak memory is read by a child of its own:
    RUSAGE_CHILDREN in the caller would count its other children too."""
    probe = ("import resource, subprocess, sys, time; start = time.perf_counter(); "
             "subprocess.run(sys.argv[1:], capture_output=True, check=True); "
             "print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", probe, str(tools / "llama-bench"), "-m", str(gguf), "-t", str(threads),
                           "-n", "1", "-p", "0", "-r", "1"], capture_output=True, text=True, check=True)
    cold, peak_kb = (float(v) for v in done.stdout.split())
    return cold, peak_kb / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="auto", choices=["auto", "stored", "stored-fast"],
                        help="auto: the default a user gets; stored: exact fp32 products; stored-fast: integer "
                             "products on int8 activations")
    parser.add_argument("--depth", type=int, default=0,
                        help="decode after this many tokens of context, both sides (default: layerplan after "
                             f"{CONTEXT}, llama-bench after none)")
    parser.add_argument("--prefill", type=int, default=0,
                        help="also time a prompt of this many tokens into an empty cache (llama-bench's pp)")
    parser.add_argument("--_layerplan-only", dest="started_at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.depth < 0 or args.prefill < 0:
        raise SystemExit(f"--depth and --prefill must be 0 or more, not {min(args.depth, args.prefill)}")
    if args.started_at is not None:
        print(json.dumps(measure_layerplan(args.model, args.new_tokens, args.threads, args.dtype, args.started_at,
                                           args.depth or CONTEXT, args.prefill)))
        return
    from layerplan.machine import read_cpuinfo
    from layerplan.models.loading import gguf_of

    gguf = gguf_of(args.model)
    if gguf is None:
        raise SystemExit(f"{args.model}: not a GGUF file")
    ours, theirs = [], []
    for _ in range(args.rounds):
        done = subprocess.run([sys.executable, __file__, args.model, "--new-tokens", str(args.new_tokens),
                               "--threads", str(args.threads), "--dtype", args.dtype, "--depth", str(args.depth),
                               "--prefill", str(args.prefill), "--_layerplan-only", repr(time.time())],
                              capture_output=True, text=True, check=True)
        ours.append(json.loads(done.stdout.strip().splitlines()[-1]))
        theirs.append(measure_llama_cpp(gguf, args.new_tokens, args.threads, args.depth, args.prefill))

    def median(runs: list[dict], key: str):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    def spread(runs: list[dict], key: str):
        values = [r[key] for r in runs if r.get(key) is not None]
        return [min(values), max(values)] if values else None

    keys = ("decode_tokens_per_second", "pass_steps", "prefill_tokens_per_second", "first_token_seconds",
            "peak_rss_mb")
    summary = {}
    for name, runs in (("layerplan", ours), ("llama.cpp", theirs)):
        summary[name] = {key: median(runs, key) for key in keys}
        summary[name]["range"] = {key: spread(runs, key) for key in keys}
    # the slowest cold start: the first round's, where it packed the panels none had kept
    summary["layerplan"]["first_token_seconds_slowest"] = max(r["first_token_seconds"] for r in ours)
    summary["ratio_first_token"] = summary["layerplan"]["first_token_seconds"] / summary["llama.cpp"]["first_token_seconds"]
    summary["ratio_decode"] = summary["layerplan"]["decode_tokens_per_second"] / summary["llama.cpp"]["decode_tokens_per_second"]
    paired = [a["decode_tokens_per_second"] / b["decode_tokens_per_second"] for a, b in zip(ours, theirs)]
    summary["ratio_decode_by_round"] = [round(r, 3) for r in paired]  # each round's pair, run back to back
    if args.prefill:
        summary["ratio_prefill"] = (summary["layerplan"]["prefill_tokens_per_second"]
                                    / summary["llama.cpp"]["prefill_tokens_per_second"])
    summary["prefill"] = args.prefill
    summary["file_mb"] = gguf.stat().st_size / 2**20
    summary["formats"] = ours[0]["formats"]
    summary["llama_cpp_build"] = theirs[0]["build"]
    summary["threads"] = args.threads
    summary["dtype"] = args.dtype
    summary["depth"] = args.depth
    summary["cpu"] = read_cpuinfo()[0]
    from layerplan.engine.kernel_library import library
    summary["kernels"] = library().isa
    print(json.dumps({"model": str(gguf), **summary}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
