"""A model drafting for itself at fewer bits, layerplan against llama.cpp, in one run: layerplan's
`--draft self:bits=FORMAT` (the model quantized again at load) against `llama-speculative-simple`
with the same model written at FORMAT as its draft model (the nearest thing to a smaller model of
the same family: the same weights at fewer bits), both beside their own plain decoding of the
same file, greedy, on the same prompt and threads.

    python benchmarks/self_draft_vs_llamacpp.py [--model smollm2] [--bits q4_0] [--new-tokens 64]

Needs llama.cpp's tools (`layerplan peers build`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from layerplan.app.llamacpp import find_tools
from layerplan.app.peers import gguf_at_precision, llama_bench, parse_lookup_output, _run_tool
from layerplan.decoding.draft_length import FixedLength
from layerplan.decoding.generate import generate
from layerplan.engine.load import load_model
from layerplan.machine import read_cpuinfo
from layerplan.models.loading import gguf_of


def decode_rate(result) -> float:
    return len(result.token_ids) / (result.seconds - result.prefill_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--bits", default="q4_0", choices=["q4_0", "q8_0"], help="the draft's format")
    parser.add_argument("--prompt", default="def quicksort(items):")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-max", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    gguf = gguf_of(args.model)
    tools = find_tools(("llama-bench", "llama-speculative-simple"))
    if gguf is None or tools is None:
        raise SystemExit("needs a GGUF model and llama.cpp's tools (layerplan peers build)")
    draft_file = gguf_at_precision(gguf, args.bits, Path(tempfile.gettempdir()) / f"{gguf.stem}-{args.bits}.gguf")

    model = load_model(args.model, dtype="stored-fast")
    ids = model.tokenizer(args.prompt).input_ids
    ours: dict[str, list[float]] = {"plain": [], "fixed": [], "adaptive": []}
    theirs: dict[str, list[float]] = {"plain": [], "draft": []}
    acceptance = {}
    for _ in range(args.rounds):  # alternating, so drift in the machine's speed hits both
        plain = generate(model, ids, max_new_tokens=args.new_tokens)
        fixed = generate(model, ids, max_new_tokens=args.new_tokens, draft=f"self:bits={args.bits}",
                         draft_length=FixedLength(args.draft_max))
        adaptive = generate(model, ids, max_new_tokens=args.new_tokens, draft=f"self:bits={args.bits}")
        assert fixed.token_ids == plain.token_ids == adaptive.token_ids  # lossless
        ours["plain"].append(decode_rate(plain))
        ours["fixed"].append(decode_rate(fixed))
        ours["adaptive"].append(decode_rate(adaptive))
        acceptance["layerplan"] = fixed.stats["accepted"] / max(fixed.stats["drafted"], 1)
        theirs["plain"].append(llama_bench(tools / "llama-bench", gguf, threads, args.new_tokens).tg_tokens_per_second)
        run = parse_lookup_output(_run_tool(
            [str(tools / "llama-speculative-simple"), "-m", str(gguf), "-md", str(draft_file), "--spec-type",
             "draft-simple", "-p", args.prompt, "-n", str(args.new_tokens), "--temp", "0", "-t", str(threads), "-tb",
             str(threads), "--spec-draft-n-max", str(args.draft_max), "-c", "2048"], "llama-speculative-simple"))
        theirs["draft"].append(run.decode_tokens_per_second)
        acceptance["llama.cpp"] = run.acceptance_rate
    best = {name: {k: max(v) for k, v in rows.items()} for name, rows in (("layerplan", ours), ("llama.cpp", theirs))}
    print(json.dumps({
        "model": str(gguf), "draft": f"self:bits={args.bits} / -md {draft_file.name}", "draft_max": args.draft_max,
        "tokens_per_second": best, "acceptance": acceptance,
        "layerplan_fixed_vs_plain": best["layerplan"]["fixed"] / best["layerplan"]["plain"],
        "layerplan_adaptive_vs_plain": best["layerplan"]["adaptive"] / best["layerplan"]["plain"],
        "llama_cpp_draft_vs_plain": best["llama.cpp"]["draft"] / best["llama.cpp"]["plain"],
        "layerplan_fixed_vs_llama_cpp_draft": best["layerplan"]["fixed"] / best["llama.cpp"]["draft"],
        "layerplan_adaptive_vs_llama_cpp_draft": best["layerplan"]["adaptive"] / best["llama.cpp"]["draft"],
        "cpu": read_cpuinfo()[0], "threads": threads, "load_average": os.getloadavg()[0],
    }, indent=2))


if __name__ == "__main__":
    main()
