"""A cold start to the first token: `layerplan generate` on a GGUF as a new process, against
llama.cpp's own cold start on the same file (issue 28's targets: at most 2x llama.cpp's time; a
peak resident memory of at most 1.3x the file + the KV cache + 300 MB).

    python benchmarks/cold_start.py [MODEL] [--rounds 3] [--dtype stored-fast]

Each round times three new processes, in turn (so a change in the machine's load falls on all):
`layerplan generate PROMPT -n 1` as a user runs it (the light front end, layerplan/lite/: numpy
and the kernels), the same command on the torch front end (LAYERPLAN_FRONT_END=torch: torch and
transformers), and `llama-bench -n 1 -p 0` (load, then one token). Each is timed from its spawn
to its exit (the interpreter, imports, the tokenizer, the prompt's pass and the token included
for layerplan), with its peak RSS (ru_maxrss of a child of a probe process of its own). One
warm-up run of each front end first: the first load of a file indexes it and packs its panels
(kept on disk, as llama.cpp keeps nothing: its file is mapped as it is), and that is a first
start, not a cold one. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

PROMPT = "The capital of France is"


def timed(command: list[str], env: dict | None = None) -> tuple[float, float]:
    """(seconds from spawn to exit, peak RSS in MB) of a command in a probe process of its own
    (RUSAGE_CHILDREN in this one would count its other children too)."""
    probe = ("import resource, subprocess, sys, time; start = time.perf_counter(); "
             "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True); "
             "print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, check=True,
                          env=env)
    seconds, peak_kb = (float(v) for v in done.stdout.split())
    return seconds, peak_kb / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="stored-fast", choices=["stored", "stored-fast"])
    args = parser.parse_args()
    import compileall

    import layerplan
    from layerplan.app.llamacpp import find_tools
    from layerplan.machine import read_cpuinfo
    from layerplan.models.gguf_place import gguf_of

    # layerplan's modules compiled, as an installed wheel has them (an editable install compiles
    # a module at its first import; under PYTHONDONTWRITEBYTECODE, at every start's)
    compileall.compile_dir(os.path.dirname(layerplan.__file__), quiet=1)
    tools = find_tools()
    if tools is None:
        raise SystemExit("llama.cpp's tools are not built: layerplan peers build")
    gguf = gguf_of(args.model)
    if gguf is None:
        raise SystemExit(f"{args.model}: not a GGUF file")
    layerplan = shutil.which("layerplan") or os.path.join(os.path.dirname(sys.executable), "layerplan")
    generate = [layerplan, "generate", PROMPT, "-n", "1", "--model", str(gguf), "--dtype", args.dtype,
                "--threads", str(args.threads)]
    torch_env = {**os.environ, "LAYERPLAN_FRONT_END": "torch"}
    llama = [str(tools / "llama-bench"), "-m", str(gguf), "-t", str(args.threads), "-n", "1", "-p", "0", "-r", "1"]
    first = {"torch front end": timed(generate, torch_env), "layerplan": timed(generate)}  # index, panels
    runs: dict[str, list[tuple[float, float]]] = {"layerplan": [], "torch front end": [], "llama.cpp": []}
    for _ in range(args.rounds):
        runs["layerplan"].append(timed(generate))
        runs["torch front end"].append(timed(generate, torch_env))
        runs["llama.cpp"].append(timed(llama))
    best = {name: (min(s for s, _ in rows), min(p for _, p in rows)) for name, rows in runs.items()}
    file_mb = gguf.stat().st_size / 2**20
    print(json.dumps({
        "model": str(gguf), "dtype": args.dtype, "cpu": read_cpuinfo()[0], "rounds": args.rounds,
        "seconds": {name: round(b[0], 3) for name, b in best.items()},
        "seconds_slowest": {name: round(max(s for s, _ in rows), 3) for name, rows in runs.items()},
        "peak_rss_mb": {name: round(b[1], 1) for name, b in best.items()},
        "first_start_seconds": {name: round(s, 2) for name, (s, _) in first.items()},
        "file_mb": round(file_mb, 1),
        "layerplan_vs_llama_cpp": round(best["layerplan"][0] / best["llama.cpp"][0], 2),
        "torch_front_end_vs_llama_cpp": round(best["torch front end"][0] / best["llama.cpp"][0], 2),
        "memory_allowed_mb_without_kv": round(1.3 * file_mb + 300, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
