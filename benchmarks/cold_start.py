"""A cold start to the first token: `layerplan generate` (or `chat`) on a GGUF as a new process,
against llama.cpp's own cold start on the same file (issue 28's targets: at most 2x llama.cpp's
time; a peak resident memory of at most 1.3x the file + the KV cache + 300 MB).

    python benchmarks/cold_start.py [MODEL] [--rounds 3] [--dtype stored-fast] [--command chat] [--temp 0.8] [--draft suffix]

Each round times three new processes, in turn (so a change in the machine's load falls on all):
`layerplan generate PROMPT -n 1` as a user runs it (the light front end, layerplan/lite/: numpy
and the kernels), the same command on the torch front end (LAYERPLAN_FRONT_END=torch: torch and
transformers), and `llama-bench -n 1 -p 0` (load, then one token). With --command chat, the
layerplan command is `layerplan chat -n 1` with PROMPT as its one line of stdin (its reply in the
chat template, then end of input); with --temp T, the command samples (`--temp T --seed 1`); with
--draft SPEC, it drafts (`--draft SPEC`: a lookup draft starts on the light front end too). Each
figure is the median of the rounds, with their range. Each is timed from its spawn
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
import statistics
import subprocess
import sys
import tempfile

PROMPT = "The capital of France is"


def timed(command: list[str], env: dict | None = None, stdin: str | None = None) -> tuple[float, float]:
    """(seconds from spawn to exit, peak RSS in MB) of a command in a probe process of its own
    (RUSAGE_CHILDREN in this one would count its other children too); stdin: a file it reads."""
    probe = ("import os, resource, subprocess, sys, time; start = time.perf_counter(); "
             "given = os.environ.pop('COLD_START_STDIN', None); "
             "subprocess.run(sys.argv[1:], stdin=open(given) if given else subprocess.DEVNULL, "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True); "
             "print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = {**(env if env is not None else os.environ), **({"COLD_START_STDIN": stdin} if stdin else {})}
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
    parser.add_argument("--command", default="generate", choices=["generate", "chat"])
    parser.add_argument("--temp", type=float, default=0.0,
                        help="the layerplan command samples at this temperature, seeded (0: greedy)")
    parser.add_argument("--draft", default=None, help="the layerplan generate drafts with this drafter")
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
    stdin = None
    if args.command == "chat":
        layerplan_command = [layerplan, "chat", "-n", "1"]
        stdin = os.path.join(tempfile.mkdtemp(), "line.txt")
        with open(stdin, "w", encoding="utf-8") as line:
            line.write(PROMPT + "\n")
    else:
        layerplan_command = [layerplan, "generate", PROMPT, "-n", "1"]
    layerplan_command += ["--model", str(gguf), "--dtype", args.dtype, "--threads", str(args.threads)]
    if args.temp:
        layerplan_command += ["--temp", str(args.temp), "--seed", "1"]
    if args.draft:
        layerplan_command += ["--draft", args.draft]
    torch_env = {**os.environ, "LAYERPLAN_FRONT_END": "torch"}
    llama = [str(tools / "llama-bench"), "-m", str(gguf), "-t", str(args.threads), "-n", "1", "-p", "0", "-r", "1"]
    # (a first run of each: indexes the file and packs its panels)
    first = {"torch front end": timed(layerplan_command, torch_env, stdin), "layerplan": timed(layerplan_command,
                                                                                                 stdin=stdin)}
    runs: dict[str, list[tuple[float, float]]] = {"layerplan": [], "torch front end": [], "llama.cpp": []}
    for _ in range(args.rounds):
        runs["layerplan"].append(timed(layerplan_command, stdin=stdin))
        runs["torch front end"].append(timed(layerplan_command, torch_env, stdin))
        runs["llama.cpp"].append(timed(llama))
    median = {name: (statistics.median(s for s, _ in rows), statistics.median(p for _, p in rows))
              for name, rows in runs.items()}
    file_mb = gguf.stat().st_size / 2**20
    print(json.dumps({
        "model": str(gguf), "command": args.command, "dtype": args.dtype, "temperature": args.temp,
        "draft": args.draft,
        "cpu": read_cpuinfo()[0],
        "rounds": args.rounds,
        "seconds": {name: round(m[0], 3) for name, m in median.items()},
        "seconds_range": {name: [round(min(s for s, _ in rows), 3), round(max(s for s, _ in rows), 3)]
                          for name, rows in runs.items()},
        "peak_rss_mb": {name: round(m[1], 1) for name, m in median.items()},
        "first_start_seconds": {name: round(s, 2) for name, (s, _) in first.items()},
        "file_mb": round(file_mb, 1),
        "layerplan_vs_llama_cpp": round(median["layerplan"][0] / median["llama.cpp"][0], 2),
        "torch_front_end_vs_llama_cpp": round(median["torch front end"][0] / median["llama.cpp"][0], 2),
        "memory_allowed_mb_without_kv": round(1.3 * file_mb + 300, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
