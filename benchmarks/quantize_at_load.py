"""Peak memory and time of `--dtype q4_k` (a checkpoint's matrices quantized at load) on a Hugging
Face folder: read and quantized a tensor at a time (what load_model does now) against the whole
model loaded in float32 first, then quantized (quantize_linears(load_model(folder, "float32")), as it
did before). Each in a process of its own; peak RSS from the kernel's accounting.

    python benchmarks/quantize_at_load.py FOLDER [--dtype q4_k] [--rounds 3]
    python benchmarks/quantize_at_load.py --write-random qwen2-1.5b FOLDER   # random weights, bf16

--write-random writes a folder of RANDOM weights in bfloat16 with a real architecture's shapes (no
tokenizer): for memory and time only. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

SHAPES = {
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True),
}

_RUN = """
import resource, sys, time
start = time.perf_counter()
from layerplan.engine import load
from layerplan.models import loading
folder, dtype, way = sys.argv[1:4]
if way == "whole":
    from layerplan.engine.choices import QUANTIZED
    model = load.quantize_linears(loading.load_model(folder, "float32"), *QUANTIZED[dtype])
else:
    model = load.load_model(folder, dtype=dtype, engine="eager")
seconds = time.perf_counter() - start
print(seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def write_random(shape: str, folder: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def summary(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?")
    parser.add_argument("--dtype", default="q4_k")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write-random", nargs=2, metavar=("SHAPE", "FOLDER"))
    args = parser.parse_args()
    if args.write_random:
        write_random(*args.write_random)
        return
    from layerplan.machine import read_cpuinfo

    rows: dict[str, list[tuple[float, float]]] = {"by tensor": [], "whole": []}
    for _ in range(args.rounds):
        for name, way in (("by tensor", "tensor"), ("whole", "whole")):
            done = subprocess.run([sys.executable, "-c", _RUN, args.folder, args.dtype, way], capture_output=True,
                                  text=True, check=True)
            seconds, peak = (float(v) for v in done.stdout.split()[-2:])
            rows[name].append((seconds, peak))
    print(json.dumps({
        "folder": args.folder, "dtype": args.dtype, "cpu": read_cpuinfo()[0], "rounds": args.rounds,
        "seconds": {name: summary([s for s, _ in values]) for name, values in rows.items()},
        "peak_rss_mb": {name: summary([p for _, p in values], 0) for name, values in rows.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
