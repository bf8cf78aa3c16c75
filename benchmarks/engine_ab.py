"""Two revisions of the engine in one process: the working tree's package against the package at a
git revision, a whole forward each (Python, kernels, LM head), alternated pass by pass.

    python benchmarks/engine_ab.py REVISION [--dtype bfloat16] [--rounds 60] [--tokens 1 4 8]

Why one process: this project's machines drift by 10-20% over minutes, so two runs of a benchmark
minutes apart compare the host's moods as much as the code. Here both models decode the same
tokens after the same 100-token prefix, in turns; each round swaps which goes first (the second of
a pair tends to read a few percent faster), and the medians over the rounds are compared. The
logits of the two are compared too: "equal" means bit for bit.

The revision's package is extracted with `git archive` and imported under another name
(`layerplan_at_rev`: its own imports renamed), so it builds and loads its own kernels.
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

import layerplan.engine.runner as runner_now
import layerplan.engine.load as loading_now
from layerplan.machine import cpu_info

ALIAS = "layerplan_at_rev"
REPOSITORY = Path(__file__).resolve().parent.parent


def import_revision(revision: str, into: Path):
    """The package at `revision` as module ALIAS: its loader (engine/load.py; models/loading.py
    in revisions before it) and its runner."""
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", revision, "src/layerplan"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"engine_ab: git cannot archive {revision!r}: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    package = into / "src" / "layerplan"
    renamed = into / ALIAS
    package.rename(renamed)
    pattern = re.compile(r"\blayerplan(?=[.\s])")
    for source in renamed.rglob("*.py"):
        text = source.read_text()
        source.write_text("\n".join(pattern.sub(ALIAS, line) if re.match(r"\s*(from|import)\s", line) else line
                                    for line in text.split("\n")))
    sys.path.insert(0, str(into))
    loader = "engine.load" if (renamed / "engine" / "load.py").exists() else "models.loading"
    return importlib.import_module(f"{ALIAS}.{loader}"), importlib.import_module(f"{ALIAS}.engine.runner")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision", help="a git revision of this repository, e.g. HEAD~3 or a commit")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", *loading_now.QUANTIZED],
                        help="a block format (q4_k; q4_k-fast: integer products) quantizes the matrices at load")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8], help="tokens per pass")
    parser.add_argument("--engine", default="native")
    args = parser.parse_args()
    print(cpu_info().line())
    with tempfile.TemporaryDirectory() as folder:
        loading_then, runner_then = import_revision(args.revision, Path(folder))
        sides = {}
        for name, loading, runner in ((args.revision, loading_then, runner_then), ("working tree", loading_now, runner_now)):
            model = loading.load_model(None, dtype=args.dtype, engine=args.engine)
            sides[name] = (model, runner)
        ids = torch.randint(0, sides["working tree"][0].hf.config.vocab_size, (1, 100 + max(args.tokens)),
                            generator=torch.Generator().manual_seed(0))
        runs = {}
        for name, (model, runner) in sides.items():
            plan = model.plan()
            cache = runner.new_cache(plan, capacity=ids.shape[1] + 1)
            runner.forward(model, ids[:, :100], plan, cache, 0, last_only=True)
            runs[name] = (model, runner, plan, cache)
        times = {(name, k): [] for name in runs for k in args.tokens}
        logits = {}
        names = list(runs)
        for r in range(args.rounds + 1):
            for name in names if r % 2 == 0 else names[::-1]:
                model, runner, plan, cache = runs[name]
                for k in args.tokens:
                    cache.crop(100)
                    start = time.perf_counter()
                    logits[(name, k)] = runner.forward(model, ids[:, 100:100 + k], plan, cache, 100)
                    if r:  # the first round warms up
                        times[(name, k)].append(time.perf_counter() - start)
        then, now = names
        print(f"{args.dtype}, {args.engine} engine, {args.rounds} rounds, medians of whole forwards after 100 cached tokens")
        for k in args.tokens:
            a, b = statistics.median(times[(then, k)]) * 1e3, statistics.median(times[(now, k)]) * 1e3
            equal = torch.equal(logits[(then, k)], logits[(now, k)])
            diff = (logits[(then, k)].float() - logits[(now, k)].float()).abs().max().item()
            print(f"{k:>2} tokens: {then} {a:.2f} ms, working tree {b:.2f} ms, ratio {b / a:.3f}; logits "
                  + ("equal" if equal else f"differ (largest difference {diff:.2e})"))


if __name__ == "__main__":
    main()
