"""Decoding on a CUDA GPU (`--device cuda`, the eager engine over the model's own modules), against
transformers' own generate on the same GPU, the same weights, in the same run; and what a pass of
k tokens costs against a one-token step there (what a speculative round's verify pays).

    python benchmarks/gpu_decode.py [--shapes smollm2-135m,qwen2-1.5b,llama3-8b] [--new-tokens 128]
                                    [--repeats 3] [--draft suffix --draft exit:8] [--out FILE]
    python benchmarks/gpu_decode.py --model FILE.gguf [--prompts chat,code] ...

The --shapes models are random-weight bfloat16 models of real architectures' shapes (no weights
are downloaded: the GPU machine reaches nothing), so the tokens are a random model's: the timings
are what they are for a trained model of the shape; acceptance rates are not. --model runs a real
file (a GGUF dequantized to bfloat16 on the GPU, or a checkpoint folder) on the bench's built-in
prompts instead: its acceptance rates are a trained model's. Greedy, no EOS
(every run decodes --new-tokens tokens); the prompt is 96 token ids with a repeated stretch.
Prints a table and one JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS
from layerplan.decoding.generate import generate
from layerplan.engine.load import load_model, wrap_model
from layerplan.engine.runner import forward, new_cache

SHAPES = {  # published configs' shapes; vocabularies as the models have them
    "smollm2-135m": lambda: LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                        max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2-1.5b": lambda: Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                      num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                      max_position_embeddings=32768, tie_word_embeddings=True),
    "llama3-8b": lambda: LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                     max_position_embeddings=8192, rope_theta=500000.0),
}


def random_model(shape: str, device: torch.device):
    config = SHAPES[shape]()
    config.eos_token_id = None  # a random model's text runs its full length
    torch.manual_seed(0)
    with device:
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return wrap_model(hf.eval(), name=f"{shape} (random weights)")


def prompt_ids(vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(1)
    head = torch.randint(10, vocab, (48,), generator=generator).tolist()
    return head + head[8:40] + head[:16]  # 96 ids, a stretch repeated


def timed(fn, device) -> float:
    """Seconds of fn(), the GPU's queued work included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def decode_rows(model, ids: list[int], new_tokens: int, repeats: int, drafts: list[str], device) -> list[dict]:
    tensor = torch.tensor([ids], device=device)
    runs = {"transformers generate": lambda n: model.hf.generate(
        tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):].tolist(),
            "layerplan plain": lambda n: generate(model, ids, max_new_tokens=n, stop_at_eos=False)}
    for draft in drafts:
        runs[f"layerplan draft={draft}"] = (lambda d: lambda n: generate(model, ids, max_new_tokens=n, stop_at_eos=False,
                                                                          draft=d))(draft)
    for run in runs.values():
        run(4)  # warm-up: kernels chosen, buffers allocated
    seconds = {name: [] for name in runs}
    outputs = {}
    for _ in range(repeats):  # the methods in turn, round after round: a host's drift falls on all alike
        for name, run in runs.items():
            out = {}
            seconds[name].append(timed(lambda: out.setdefault("r", run(new_tokens)), device))
            outputs[name] = out["r"]
    rows = []
    for name in runs:
        result = outputs[name]
        tokens = result if isinstance(result, list) else result.token_ids
        stats = {} if isinstance(result, list) else result.stats
        median = statistics.median(seconds[name])
        rows.append({"method": name, "tokens": len(tokens), "seconds": median, "tokens_per_second": len(tokens) / median,
                     "token_ids": tokens,
                     "acceptance_rate": stats.get("acceptance_rate"), "mean_accepted_length": stats.get("mean_accepted_length"),
                     # where a drafting run's time went (the last run): its rounds, drafts, and seconds
                     **{key: stats.get(key) for key in ("rounds", "drafted", "draft_seconds", "verify_seconds")}})
    plain = next(r for r in rows if r["method"] == "layerplan plain")
    reference = rows[0]
    for row in rows:
        row["vs_transformers"] = row["tokens_per_second"] / reference["tokens_per_second"]
        row["same_tokens_as_plain"] = row["token_ids"] == plain["token_ids"]
        row["first_difference"] = next((i for i, (a, b) in enumerate(zip(row["token_ids"], plain["token_ids"])) if a != b), None)
    for row in rows:
        del row["token_ids"]
    return rows


def pass_costs(model, ids: list[int], device, ks=(1, 2, 4, 8, 16, 32), repeats: int = 20) -> dict[int, float]:
    """Milliseconds of a pass of k tokens after the prompt (cache filled), median of `repeats`."""
    plan = model.plan()
    cache = new_cache(plan, capacity=len(ids) + max(ks) + 8)
    forward(model, torch.tensor([ids], device=device), plan, cache, 0)
    costs = {}
    for k in ks:
        chunk = torch.tensor([ids[:k]], device=device)
        samples = []
        for _ in range(repeats + 2):
            samples.append(timed(lambda: forward(model, chunk, plan, cache, len(ids), last_only=False), device))
            cache.crop(len(ids))
        costs[k] = statistics.median(samples[2:]) * 1000
    return costs


def gpu_busy(model, ids: list[int], device, steps: int = 8) -> dict:
    """Wall milliseconds of a one-token decode step and the milliseconds its GPU kernels ran (the
    profiler's device time): what is left is the host launching them (Python, the framework)."""
    from torch.profiler import ProfilerActivity, profile

    plan = model.plan()
    cache = new_cache(plan, capacity=len(ids) + steps + 8)
    forward(model, torch.tensor([ids], device=device), plan, cache, 0)
    token = torch.tensor([[ids[-1]]], device=device)
    forward(model, token, plan, cache, len(ids))  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = timed(lambda: [forward(model, token, plan, cache, len(ids) + i) for i in range(steps)], device)
    kernels = sum(event.self_device_time_total for event in prof.key_averages()) / 1000  # microseconds -> ms
    return {"step_ms": wall * 1000 / steps, "kernel_ms": kernels / steps,
            "launches_per_step": sum(e.count for e in prof.key_averages() if e.self_device_time_total > 0) / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,qwen2-1.5b,llama3-8b")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft", action="append", default=None, help="layerplan drafter(s); default: suffix and exit:8")
    parser.add_argument("--model", action="append", default=[], help="a real GGUF file or checkpoint folder (repeatable); "
                        "runs the built-in prompts instead of --shapes")
    parser.add_argument("--prompts", default="chat,code", help=f"built-in prompts for --model ({', '.join(PROMPTS)})")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N (cpu: to check the script itself)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    drafts = args.draft if args.draft is not None else ["suffix", "exit:8"]
    report = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "models": []}
    import transformers
    report["transformers"] = transformers.__version__
    print(f"{report['gpu']}, torch {report['torch']}, transformers {report['transformers']}; bfloat16, greedy, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    cases = ([(source, name) for source in args.model for name in args.prompts.split(",")] if args.model
             else [(shape, None) for shape in args.shapes.split(",")])
    loaded = {}
    for source, prompt in cases:
        if prompt is None:
            model, shape = random_model(source, device), source
            ids, weights = prompt_ids(model.hf.config.vocab_size), "random weights"
        else:
            if loaded.get("source") != source:  # one load per file, whatever its prompts
                loaded.clear()
                loaded.update(source=source, model=load_model(source, dtype="bfloat16", device=device, engine="eager"))
            model = loaded["model"]
            ids, weights = model.encode(PROMPTS[prompt], chat=prompt in CHAT_PROMPTS)[0].tolist(), "real weights"
            shape = f"{Path(source).name} / {prompt}"
        rows = decode_rows(model, ids, args.new_tokens, args.repeats, drafts, device)
        costs = pass_costs(model, ids, device)
        busy = None
        if device.type == "cuda":
            try:
                busy = gpu_busy(model, ids, device)
            except Exception as error:  # the profiler is a bonus: the rows stand without it
                print(f"  (no kernel profile: {error})")
        report["models"].append({"shape": shape, "weights": weights, "prompt_tokens": len(ids), "rows": rows, "pass_ms": costs,
                                 "pass_steps": {k: v / costs[1] for k, v in costs.items()}, "gpu_busy": busy})
        print(f"\n{shape} ({weights}, bfloat16, {len(ids)}-token prompt)")
        for row in rows:
            accept = (f"  accept {row['acceptance_rate']:.2f}, {row['rounds']} rounds: drafting {row['draft_seconds']:.2f} s, "
                      f"verifying {row['verify_seconds']:.2f} s") if row["rounds"] is not None else ""
            print(f"  {row['method']:<28} {row['tokens_per_second']:8.1f} tok/s  {row['vs_transformers']:5.2f}x HF"
                  f"  same as plain: {row['same_tokens_as_plain']}{accept}")
        print("  k-token pass / 1-token step: " + ", ".join(f"{k}: {v / costs[1]:.2f}" for k, v in costs.items())
              + f"  (1 token {costs[1]:.2f} ms)")
        if busy:
            print(f"  a decode step: {busy['step_ms']:.2f} ms wall, its GPU kernels {busy['kernel_ms']:.2f} ms "
                  f"({busy['launches_per_step']:.0f} kernels)")
        del model
        torch.cuda.empty_cache()
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
