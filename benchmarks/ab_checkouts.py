"""This checkout against another one, alternated in one run (a change's effect beside the host's
drift), spawn to exit:

    python benchmarks/ab_checkouts.py start OTHER_SRC [--rounds 9]
        a later `layerplan generate "The capital of France is" -n 1` on the packaged model
        (the light front end's start)
    python benchmarks/ab_checkouts.py first-ppl OTHER_SRC FILE [--rounds 3]
        the first `layerplan ppl -m FILE --max-tokens 64 --window 64 --stride 32` of a file never
        seen (a fresh cache holding only the kernels' library): time, peak RSS, dense files written

    python benchmarks/ab_checkouts.py help OTHER_SRC [--rounds 5]
        `layerplan CMD -h` of every command that runs torch (what a user waits for to read its
        options, or to be told an option is mistyped), each command's seconds apart

OTHER_SRC is the other checkout's src/ folder (put ahead of this one's on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH = "import sys; from layerplan.app.launch import main; sys.argv = ['layerplan', *sys.argv[1:]]; main()"
CLI = ("import resource, sys\nsys.argv = ['layerplan', *sys.argv[1:]]\nfrom layerplan.app.cli import main\n"
       "try:\n    main()\nexcept SystemExit:\n    pass\n"
       "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")


def _env(src: str | None, **extra: str) -> dict:
    # (each checkout's kernels keep their panels: the two builds alternate, neither packs again)
    env = {**os.environ, "LAYERPLAN_PANEL_BUILDS": "2", **extra}
    if src is not None:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start(src: str | None) -> dict:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", LAUNCH, "generate", "The capital of France is", "-n", "1"], env=_env(src),
                   capture_output=True, check=True)
    return {"wall_s": time.perf_counter() - began}


# the commands whose work runs torch (the others never imported it for their help)
TORCH_COMMANDS = ("generate", "serve", "bench", "probe", "frontier", "export", "eval", "train-exit", "tune")


def help_times(src: str | None) -> dict:
    times = {}
    for command in TORCH_COMMANDS:
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", LAUNCH, command, "-h"], env=_env(src), capture_output=True, check=True)
        times[f"{command}_s"] = time.perf_counter() - began
    return times


def first_ppl(src: str | None, gguf: str) -> dict:
    from layerplan.files import cache_dir

    with tempfile.TemporaryDirectory() as cache:
        built = cache_dir() / "native"
        if built.exists():  # (the kernels' library, built once per machine: not what is timed)
            shutil.copytree(built, Path(cache) / "native", symlinks=True)
        began = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CLI, "ppl", "-m", gguf, "--max-tokens", "64", "--window", "64",
                              "--stride", "32"], env=_env(src, LAYERPLAN_CACHE=cache), capture_output=True, text=True)
        wall = time.perf_counter() - began
        if out.returncode != 0:
            raise SystemExit(out.stderr[-2000:])
        peak = next(int(line.split()[1]) for line in reversed(out.stderr.splitlines()) if line.startswith("PEAK"))
        dense = sorted(str(p) for p in Path(cache).rglob("*.safetensors"))
    return {"wall_s": wall, "peak_mb": peak / 1024, "dense_files": len(dense)}


def _summary(runs: list[dict]) -> dict:
    keys = runs[0].keys()
    return {key: f"{statistics.median(r[key] for r in runs):.3f} "
                 f"({min(r[key] for r in runs):.3f}-{max(r[key] for r in runs):.3f})" for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("start", "first-ppl", "help"))
    parser.add_argument("other_src")
    parser.add_argument("file", nargs="?")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    if args.what == "first-ppl" and not args.file:
        parser.error("first-ppl needs the GGUF FILE")
    run = {"start": start, "help": help_times}.get(args.what) or (
        lambda src: first_ppl(src, str(Path(args.file).expanduser())))
    rounds = args.rounds or {"start": 9, "help": 5}.get(args.what, 3)
    if args.what == "start":  # (the later start: the file's index, panels and the page cache made first)
        run(None), run(args.other_src)
    here, there = [], []
    for _ in range(rounds):
        here.append(run(None))
        there.append(run(args.other_src))
    ratios = {key: round(statistics.median(r[key] for r in here) / statistics.median(r[key] for r in there), 3)
              for key in here[0] if key.endswith("_s")}
    print({"this": _summary(here), "other": _summary(there), "ratios": ratios})


if __name__ == "__main__":
    main()
