"""The first run on a GGUF never seen: `layerplan generate --model FILE PROMPT -n 1` with default
settings and no cache of that file (issue 47's targets: time to the first token at most 3x
llama.cpp's cold start, peak RSS at most 1.3x the file + the KV cache + 300 MB, nothing dense
written), against `llama-bench -m FILE -p 0 -n 1 -r 1` from spawn to exit, in the same page-cache
state; and a later run (the file's index and panels made) against the same llama.cpp run.

    python benchmarks/first_run.py FILE [--rounds 3] [--drop-caches]

Each round gives layerplan a cache folder of its own holding only the native kernels' library
(built once per machine at the first run of any model, not per file): the file's index and packed
panels are made in the round, as a new user's first run makes them. --drop-caches empties the
kernel's page cache before each timed command (root only), so the file is read from disk by each.
Figures: the median of the rounds, with the slowest and fastest. Prints one JSON object.
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
from pathlib import Path

from cold_start import PROMPT, timed  # (benchmarks/: this script's folder)


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def summary(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--drop-caches", action="store_true")
    args = parser.parse_args()
    from layerplan.app.llamacpp import find_tools, peer_name
    from layerplan.files import cache_dir
    from layerplan.machine import read_cpuinfo

    tools = find_tools()
    if tools is None:
        raise SystemExit("llama.cpp's tools are not built: layerplan peers build")
    native = cache_dir() / "native"
    if not native.exists():
        raise SystemExit(f"no kernels' library in {native}: run any layerplan command once first")
    gguf = Path(args.model).resolve()
    layerplan = shutil.which("layerplan") or os.path.join(os.path.dirname(sys.executable), "layerplan")
    generate = [layerplan, "generate", PROMPT, "-n", "1", "--model", str(gguf)]  # default settings
    llama = [str(tools / "llama-bench"), "-m", str(gguf), "-t", str(args.threads), "-n", "1", "-p", "0", "-r", "1"]
    rows: dict[str, list[tuple[float, float]]] = {"first run": [], "later run": [], "llama.cpp": []}
    written, dense = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="layerplan-first-run-") as root:
            cache = Path(root) / "cache"
            shutil.copytree(native, cache / "native", symlinks=True)
            env = {**os.environ, "LAYERPLAN_CACHE": str(cache)}
            before = folder_bytes(cache)
            for name, command, command_env in (("llama.cpp", llama, None), ("first run", generate, env),
                                               ("later run", generate, env)):
                if args.drop_caches:
                    drop_page_cache()
                rows[name].append(timed(command, command_env))
                if name == "first run":
                    written.append(folder_bytes(cache) - before)
                    dense.append(sorted(str(p.relative_to(cache)) for p in cache.rglob("*.safetensors")))
    file_mb = gguf.stat().st_size / 2**20
    seconds = {name: summary([s for s, _ in values]) for name, values in rows.items()}
    peaks = {name: summary([p for _, p in values], 0) for name, values in rows.items()}
    llama_s = seconds["llama.cpp"]["median"]
    print(json.dumps({
        "model": str(gguf), "cpu": read_cpuinfo()[0], "rounds": args.rounds, "page_cache_dropped": args.drop_caches,
        "llama_cpp": peer_name(tools), "seconds": seconds, "peak_rss_mb": peaks,
        "first_run_vs_llama_cpp": round(seconds["first run"]["median"] / llama_s, 2),
        "later_run_vs_llama_cpp": round(seconds["later run"]["median"] / llama_s, 2),
        "file_mb": round(file_mb, 1), "memory_allowed_mb_without_kv": round(1.3 * file_mb + 300, 1),
        "cache_written_mb": summary([w / 2**20 for w in written], 1),
        "dense_files_written": sorted({name for names in dense for name in names}),
    }, indent=2))


if __name__ == "__main__":
    main()
